//! The DCB model: events, stored (sequenced) events, queries, conditions.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::query::text_array_bytes;
use crate::error::{Error, Result};

/// An event to append: a type, tags, JSON data and JSON metadata.
///
/// Tags are what appends and queries are narrowed by (`booking:123`); the
/// type says what happened (`BookingPlaced`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// What happened (`BookingPlaced`); non-empty, at most [`MAX_NAME_BYTES`]
    /// bytes, no NUL. Serialized as `type`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// The tags queries and conditions match on (`booking:123`); each
    /// non-empty, at most [`MAX_NAME_BYTES`] bytes, no NUL.
    pub tags: Vec<String>,
    /// The event's payload, stored as `jsonb`: nested at most
    /// [`MAX_JSON_NESTING`](crate::json::MAX_JSON_NESTING) deep, no NUL in a
    /// string or key ([`crate::json`]); with the rest of its batch, within
    /// jsonb's size limits (a string at most 268,435,455 bytes, the batch's
    /// events, as jsonb encodes them, as many in total), and the batch's
    /// JSON text, with the tags and condition sent beside it, within
    /// [`MAX_SENT_JSON_BYTES`](crate::json::MAX_SENT_JSON_BYTES) (what
    /// PostgreSQL takes in one message); past them the append is
    /// [`Error::Invalid`], nothing written. Reads back as the
    /// `Value` given, numbers included ([`crate::json::stored`]).
    pub data: Value,
    /// Data about the event rather than of it (who, why, correlation ids),
    /// stored as `jsonb`; matched by no query.
    pub metadata: Value,
}

impl Event {
    /// An event with no tags, `null` data and `{}` metadata.
    pub fn new(event_type: impl Into<String>) -> Event {
        Event {
            event_type: event_type.into(),
            tags: Vec::new(),
            data: Value::Null,
            metadata: Value::Object(Default::default()),
        }
    }

    /// Adds a tag; an empty tag is rejected when the event is appended.
    pub fn tag(mut self, tag: impl Into<String>) -> Event {
        self.tags.push(tag.into());
        self
    }

    /// Sets the payload.
    pub fn data(mut self, data: Value) -> Event {
        self.data = data;
        self
    }

    /// Sets the metadata.
    pub fn metadata(mut self, metadata: Value) -> Event {
        self.metadata = metadata;
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.event_type.is_empty() {
            return Err(Error::invalid("event", "the type must not be empty"));
        }
        if self.tags.iter().any(String::is_empty) {
            return Err(Error::invalid("event", "a tag must not be empty"));
        }
        if self.event_type.contains('\0') || self.tags.iter().any(|t| t.contains('\0')) {
            return Err(Error::invalid(
                "event",
                "a type or tag must contain no NUL character (PostgreSQL's text cannot hold it)",
            ));
        }
        if self.event_type.len() > MAX_NAME_BYTES
            || self.tags.iter().any(|t| t.len() > MAX_NAME_BYTES)
        {
            return Err(Error::invalid(
                "event",
                format!(
                    "a type or tag is at most {MAX_NAME_BYTES} bytes (each is an index entry, \
                     and PostgreSQL's index entries are limited to about a third of a page)"
                ),
            ));
        }
        crate::json::check_storable("event data", &self.data)?;
        crate::json::check_storable("event metadata", &self.metadata)?;
        Ok(())
    }
}

/// The longest type or tag an event may carry, in bytes. Each is an index
/// entry (the GIN on `tags`, the B-tree on `(type, position)`), which
/// PostgreSQL limits to about 2,700 bytes after compression; a longer one
/// failed the append with a database error (SQLSTATE 54000) depending on
/// how well it compressed. 2,048 fits whatever the bytes are.
pub const MAX_NAME_BYTES: usize = 2048;

/// The most items a [`Query`] holds. A read and a subscription send each
/// item's tags and types as parameters of one statement, and PostgreSQL's
/// protocol takes at most 65,535 parameters: a query of 70,000 items was
/// accepted, then failed every read and every poll of its subscription.
/// Two parameters per item at most, so 10,000 items leave room.
pub const MAX_QUERY_ITEMS: usize = 10_000;

/// An event as stored, with its position in the global log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredEvent {
    /// Position in the log: drawn at insert, so positions increase with
    /// insert order, not commit order (see the module docs on I5).
    pub position: i64,
    /// The event as appended; its fields serialize inline beside `position`.
    #[serde(flatten)]
    pub event: Event,
}

/// One item of a [`Query`]: matches an event whose type is any of `types`
/// (or any type when `types` is empty) and which carries all of `tags`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryItem {
    /// Event types any of which matches; empty matches every type.
    pub types: Vec<String>,
    /// Tags an event must all carry; empty matches any tags.
    pub tags: Vec<String>,
}

impl QueryItem {
    /// An empty item, to be narrowed with [`QueryItem::types`] and
    /// [`QueryItem::tags`]; a query rejects an item left empty.
    pub fn new() -> QueryItem {
        QueryItem::default()
    }

    /// Adds types to the item's alternatives.
    pub fn types<S: Into<String>>(mut self, types: impl IntoIterator<Item = S>) -> QueryItem {
        self.types.extend(types.into_iter().map(Into::into));
        self
    }

    /// Adds tags the event must carry.
    pub fn tags<S: Into<String>>(mut self, tags: impl IntoIterator<Item = S>) -> QueryItem {
        self.tags.extend(tags.into_iter().map(Into::into));
        self
    }

    /// Whether `event` matches this item (the same rule the SQL applies).
    pub fn matches(&self, event: &Event) -> bool {
        (self.types.is_empty() || self.types.contains(&event.event_type))
            && self.tags.iter().all(|t| event.tags.contains(t))
    }
}

/// A query: the OR of its items, or every event ([`Query::all`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Query {
    /// Matches every event.
    All,
    /// Matches an event that matches at least one item. Never empty.
    Items(Vec<QueryItem>),
}

impl Query {
    /// The query that matches every event.
    pub fn all() -> Query {
        Query::All
    }

    /// The OR of `items`; at least one, each naming a type or a tag, and
    /// all of them, sent as text arrays or as JSON text, within
    /// [`MAX_SENT_JSON_BYTES`](crate::json::MAX_SENT_JSON_BYTES).
    pub fn items(items: impl IntoIterator<Item = QueryItem>) -> Result<Query> {
        let query = Query::Items(items.into_iter().collect());
        query.validate()?;
        Ok(query)
    }

    /// One item: events of any of `types` (any type if empty) carrying all
    /// of `tags`.
    pub fn item<S: Into<String>, T: Into<String>>(
        types: impl IntoIterator<Item = S>,
        tags: impl IntoIterator<Item = T>,
    ) -> Result<Query> {
        Query::items([QueryItem::new().types(types).tags(tags)])
    }

    /// Whether `event` matches the query (the same rule the SQL applies).
    pub fn matches(&self, event: &Event) -> bool {
        match self {
            Query::All => true,
            Query::Items(items) => items.iter().any(|i| i.matches(event)),
        }
    }

    /// The tags of the query's one item, when it has exactly one and that
    /// item names tags and no types: the shape the one-statement append
    /// and decision read run with plans kept (migration 0170). `None` for
    /// any other query, which they run through a query built as text and
    /// planned for its values.
    pub(crate) fn tag_item(&self) -> Option<&[String]> {
        match self {
            Query::Items(items)
                if items.len() == 1 && !items[0].tags.is_empty() && items[0].types.is_empty() =>
            {
                Some(&items[0].tags)
            }
            _ => None,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let Query::Items(items) = self else {
            return Ok(());
        };
        if items.is_empty() {
            return Err(Error::invalid(
                "query",
                "a query needs at least one item; use Query::all() to match every event",
            ));
        }
        if items.len() > MAX_QUERY_ITEMS {
            return Err(Error::invalid(
                "query",
                format!(
                    "a query holds at most {MAX_QUERY_ITEMS} items, got {}",
                    items.len()
                ),
            ));
        }
        for item in items {
            if item.types.is_empty() && item.tags.is_empty() {
                return Err(Error::invalid(
                    "query item",
                    "an item names at least one type or tag; use Query::all() to match every event",
                ));
            }
            if item.types.iter().chain(&item.tags).any(String::is_empty) {
                return Err(Error::invalid(
                    "query item",
                    "types and tags must not be empty",
                ));
            }
            if item
                .types
                .iter()
                .chain(&item.tags)
                .any(|t| t.contains('\0'))
            {
                return Err(Error::invalid(
                    "query item",
                    "types and tags must contain no NUL character (PostgreSQL's text cannot hold it)",
                ));
            }
        }
        // A read, a decision or a subscription sends the items in one
        // statement, as text arrays or as JSON text: past PostgreSQL's
        // 1 GiB message the server dropped the connection. Both are
        // counted, neither written; the JSON text (a walk of every byte)
        // only when the arrays are within the limit.
        let arrays: usize = items
            .iter()
            .map(|i| text_array_bytes(&i.types) + text_array_bytes(&i.tags))
            .sum();
        let sent = if arrays > crate::json::MAX_SENT_JSON_BYTES {
            arrays
        } else {
            arrays.max(items_json_len(items))
        };
        if sent > crate::json::MAX_SENT_JSON_BYTES {
            return Err(Error::invalid(
                "query",
                format!(
                    "its types and tags take {sent} bytes to send, past the {} one statement \
                     sends PostgreSQL (which takes a message of at most 1 GiB)",
                    crate::json::MAX_SENT_JSON_BYTES
                ),
            ));
        }
        Ok(())
    }
}

/// The length of `items`' JSON text (`serde_json::to_string(items)`:
/// `[{"types":[..],"tags":[..]},..]`), counted without writing it.
fn items_json_len(items: &[QueryItem]) -> usize {
    let each: usize = items
        .iter()
        .map(|i| {
            r#"{"types":"#.len()
                + crate::json::string_array_len(&i.types)
                + r#","tags":"#.len()
                + crate::json::string_array_len(&i.tags)
                + "}".len()
        })
        .sum();
    2 + items.len().saturating_sub(1) + each
}

/// The condition of an append: fail if an event matching `fail_if_events_match`
/// exists after position `after` (anywhere, when `after` is `None`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppendCondition {
    /// The events whose existence makes the append fail.
    pub fail_if_events_match: Query,
    /// The position the decision was made at ([`Decision::after`]): only events
    /// above it count; `None` counts every event.
    pub after: Option<i64>,
}

impl AppendCondition {
    /// The condition "no event matching `fail_if_events_match` after `after`".
    pub fn new(fail_if_events_match: Query, after: Option<i64>) -> AppendCondition {
        AppendCondition {
            fail_if_events_match,
            after,
        }
    }
}

/// Options of [`crate::EventStore::read`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// First position to return (inclusive). Forwards: default 1; backwards:
    /// default the head.
    pub from: Option<i64>,
    /// At most this many events (0 or more; a negative limit is
    /// [`Error::Invalid`]); default all.
    pub limit: Option<i64>,
    /// Newest first.
    pub backwards: bool,
}

impl ReadOptions {
    /// [`Error::Invalid`] for a negative `limit`, which PostgreSQL refuses
    /// (`LIMIT must not be negative`) as a bare database error.
    pub(crate) fn validate(&self) -> Result<()> {
        match self.limit {
            Some(limit) if limit < 0 => Err(Error::invalid(
                "read options",
                format!("limit must not be negative, got {limit}"),
            )),
            _ => Ok(()),
        }
    }
}

/// What [`crate::EventStore::decide`] read: the matching events and the
/// position to pass as [`AppendCondition::after`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Decision {
    /// The events matching the decision's query, in position order.
    pub events: Vec<StoredEvent>,
    /// The head of the log when the events were read; `None` for an empty
    /// log. Every event matching the query at or below it is in `events`.
    pub after: Option<i64>,
}

/// What a successful append stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Appended {
    /// The positions of the appended events, in the order given.
    pub positions: Vec<i64>,
    /// Serialization failures retried before it went through (SSI only).
    pub retries: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The items' JSON text is counted as serde_json writes it: no item,
    /// one, several, empty lists, and names with every escape.
    #[test]
    fn the_items_json_length_is_what_serde_json_writes() {
        let escapes = "quote \" backslash \\ control \u{1} tab \t é 😀 \u{2028} \u{7f}";
        let cases = [
            vec![],
            vec![QueryItem::new().tags(["t"])],
            vec![QueryItem::new().types(["A", "B"]).tags(["t1", "t2"])],
            vec![
                QueryItem::new().types([escapes]),
                QueryItem::new().tags([escapes, ""]),
                QueryItem::new(),
            ],
        ];
        for items in cases {
            let written = serde_json::to_string(&items).unwrap();
            assert_eq!(items_json_len(&items), written.len(), "{written}");
        }
    }
}
