//! Conditional appends under the three strategies, and the advisory keys
//! every append publishes.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};

use super::model::{AppendCondition, Appended, Event, Query};
use super::query::{Filter, text_array_bytes};
use super::{AppendStrategy, NOTIFY_CHANNEL};
use crate::error::{Error, Result};
use crate::lock::LockKey;

/// Namespace of the advisory key per event tag: an append publishing an
/// event tagged `t` holds `LockKey::new(TAG_NAMESPACE, t)` shared, and a
/// condition on `t` takes it exclusive ([`LockKey::new`]).
pub const TAG_NAMESPACE: &str = "pgonce.events.tag";
/// Namespace of the advisory key per event type, keyed by the type name;
/// taken exclusive by a condition item that names types and no tags.
pub const TYPE_NAMESPACE: &str = "pgonce.events.type";
/// Namespace of the single "all" advisory key (key `""`), held shared by
/// every append and taken exclusive by a [`Query::All`] condition.
pub const ALL_NAMESPACE: &str = "pgonce.events.all";

/// The most advisory keys one append or decision takes (distinct tags and
/// types, and the "all" key). Each is an entry in PostgreSQL's shared lock
/// table, which is sized for `max_locks_per_transaction` (64 by default)
/// per connection: 6,400 entries on a default server of 100 connections.
/// A query of 10,000 tagged items, or a batch of as many events with a tag
/// each, passed every other check and then failed with "out of shared
/// memory" once the table ran out, and while it was filling other
/// sessions' locks failed too. A larger batch is split into several
/// appends; a condition this wide is better checked under
/// [`AppendStrategy::TableLock`] after a decision read of its own.
pub const MAX_LOCK_KEYS: usize = 1_000;

/// The keys an append takes, each shared (publishing an event) or exclusive
/// (checking a condition). A key wanted in both modes is taken exclusive.
/// A set built from events or a query holds at most [`MAX_LOCK_KEYS`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AppendKeys(BTreeMap<LockKey, bool>);

impl AppendKeys {
    /// Shared keys for every event: each tag, the type, and the "all" key.
    /// Any append that publishes an event matching a query holds, until it
    /// commits, a shared key that [`AppendKeys::condition`] of that query
    /// takes exclusive.
    pub fn publishing(events: &[Event]) -> Result<AppendKeys> {
        let mut keys = AppendKeys::default();
        for e in events {
            for t in &e.tags {
                keys.add(LockKey::new(TAG_NAMESPACE, t)?, false);
            }
            keys.add(LockKey::new(TYPE_NAMESPACE, &e.event_type)?, false);
        }
        if !events.is_empty() {
            keys.add(LockKey::new(ALL_NAMESPACE, "")?, false);
        }
        keys.check_limit("append")?;
        Ok(keys)
    }

    /// Exclusive keys that cover `query`: for an item with tags, its tags (an
    /// event matching the item carries them all); for a type-only item, its
    /// types; for [`Query::All`], the "all" key. So a type-only condition
    /// waits for every in-flight append of those types, and a match-all
    /// condition for every in-flight append.
    pub fn condition(query: &Query) -> Result<AppendKeys> {
        let mut keys = AppendKeys::default();
        match query {
            Query::All => keys.add(LockKey::new(ALL_NAMESPACE, "")?, true),
            Query::Items(items) => {
                for item in items {
                    if item.tags.is_empty() {
                        for t in &item.types {
                            keys.add(LockKey::new(TYPE_NAMESPACE, t)?, true);
                        }
                    } else {
                        for t in &item.tags {
                            keys.add(LockKey::new(TAG_NAMESPACE, t)?, true);
                        }
                    }
                }
            }
        }
        keys.check_limit("query")?;
        Ok(keys)
    }

    /// [`Error::Invalid`] naming `what` if the set holds more than
    /// [`MAX_LOCK_KEYS`] keys, checked before any of them is taken.
    fn check_limit(&self, what: &'static str) -> Result<()> {
        if self.len() > MAX_LOCK_KEYS {
            return Err(Error::Invalid {
                what,
                why: format!(
                    "an append or decision takes at most {MAX_LOCK_KEYS} lock keys (distinct \
                     tags and types), this one {}: split the events into several appends, \
                     or narrow the condition",
                    self.len()
                ),
            });
        }
        Ok(())
    }

    /// The union of both sets; a key in both is exclusive if either wants it
    /// exclusive.
    pub fn merge(mut self, other: AppendKeys) -> AppendKeys {
        for (k, exclusive) in other.0 {
            self.add(k, exclusive);
        }
        self
    }

    fn add(&mut self, key: LockKey, exclusive: bool) {
        *self.0.entry(key).or_default() |= exclusive;
    }

    /// The number of distinct keys.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is no key to take (no events and no condition).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `SELECT`'s list for begin_locked.sql: a lock call per key with the
    /// key as an integer literal, in ascending key order, then with
    /// `assign_xid` `pg_current_xact_id()`.
    fn lock_calls(&self, assign_xid: bool) -> String {
        let mut calls: Vec<String> = self
            .0
            .iter()
            .map(|(key, exclusive)| {
                let f = if *exclusive {
                    "pg_advisory_xact_lock"
                } else {
                    "pg_advisory_xact_lock_shared"
                };
                format!("{f}('{}'::int8)", key.as_i64())
            })
            .collect();
        if assign_xid {
            calls.push("pg_current_xact_id()".into());
        }
        if calls.is_empty() {
            calls.push("NULL".into());
        }
        calls.join(", ")
    }

    /// Takes the keys in ascending order in one statement and assigns the
    /// transaction id (before any position is drawn): for appends.
    pub async fn take(&self, tx: &mut Transaction<'_, Postgres>) -> Result<()> {
        self.take_with(tx, include_str!("sql/locks.sql")).await
    }

    /// Takes the keys in ascending order without assigning a transaction id,
    /// so a read-only transaction commits without a WAL flush: for decisions.
    pub async fn take_for_read(&self, tx: &mut Transaction<'_, Postgres>) -> Result<()> {
        self.take_with(tx, include_str!("sql/read_locks.sql")).await
    }

    async fn take_with(&self, tx: &mut Transaction<'_, Postgres>, sql: &'static str) -> Result<()> {
        // A merged set can pass the limit where each part stays within it.
        self.check_limit("append")?;
        let (keys, modes) = self.arrays();
        sqlx::query(sql)
            .bind(keys)
            .bind(modes)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// The keys in ascending order and, for each, whether it is exclusive:
    /// the `keys` and `exclusive` arguments of the SQL functions that lock.
    pub(crate) fn arrays(&self) -> (Vec<i64>, Vec<bool>) {
        (
            self.0.keys().map(|k| k.as_i64()).collect(),
            self.0.values().copied().collect(),
        )
    }
}

/// An append whose events are inserted and whose condition held, in a
/// transaction not yet committed: [`PendingAppend::commit`] publishes it.
/// Dropping it rolls it back. Until then it holds its strategy's locks.
#[derive(Debug)]
pub struct PendingAppend {
    tx: Transaction<'static, Postgres>,
    positions: Vec<i64>,
    strategy: AppendStrategy,
}

impl PendingAppend {
    /// The positions drawn for the events (not visible before commit).
    pub fn positions(&self) -> &[i64] {
        &self.positions
    }

    /// Commits. Under [`AppendStrategy::Serializable`] this is where a
    /// conflicting concurrent append is detected
    /// ([`Error::SerializationFailure`]).
    pub async fn commit(self) -> Result<Vec<i64>> {
        let strategy = self.strategy;
        self.tx.commit().await.inspect_err(|e| {
            if let Some(code) = sqlx::Error::as_database_error(e).and_then(|d| d.code())
                && code == crate::error::sqlstate::SERIALIZATION_FAILURE
            {
                metrics::counter!("pgonce_events_aborts_total", "strategy" => strategy.name())
                    .increment(1);
            }
        })?;
        Ok(self.positions)
    }

    /// Rolls back: nothing of the append is written and its locks are
    /// released.
    pub async fn rollback(self) -> Result<()> {
        self.tx.rollback().await?;
        Ok(())
    }
}

/// One attempt: BEGIN at the strategy's isolation, take its locks, check the
/// condition, insert. The transaction is left open.
pub(crate) async fn begin(
    pool: &PgPool,
    strategy: AppendStrategy,
    notify: bool,
    events: &[Event],
    condition: Option<&AppendCondition>,
) -> Result<PendingAppend> {
    let keys = validated_keys(strategy, events, condition)?;
    let isolation = match strategy {
        AppendStrategy::Serializable => Isolation::Serializable,
        AppendStrategy::TableLock | AppendStrategy::AdvisoryLocks => Isolation::ReadCommitted,
    };
    let mut tx = begin_locked(
        pool,
        isolation,
        &keys,
        true,
        strategy == AppendStrategy::TableLock,
    )
    .await?;
    let read_later = strategy == AppendStrategy::Serializable;
    let Some(c) = condition else {
        let positions = insert(&mut tx, notify, read_later, events).await?;
        return Ok(PendingAppend {
            tx,
            positions,
            strategy,
        });
    };
    // Check and insert in one statement, whose snapshot (READ COMMITTED) is
    // taken after begin_locked granted the locks, so it sees every append
    // they waited for.
    let filter = Filter::new(&c.fail_if_events_match, 5);
    let position = match strategy {
        AppendStrategy::Serializable => "e.position + 0",
        _ => "e.position",
    };
    let sql = include_str!("sql/insert_checked.sql").replace("{position}", position);
    let CheckedInsert {
        matching,
        positions,
    } = filter
        .bind_as(
            sqlx::query_as(filter.statement(&sql))
                .bind(c.after.unwrap_or(0))
                .bind(events_json(events, filter.sent_bytes())?)
                .bind(notify.then_some(NOTIFY_CHANNEL))
                .bind(read_later),
        )
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| crate::json::too_large("event", e))?;
    if !matching.is_empty() {
        tx.rollback().await?;
        return Err(refused(strategy, c, matching));
    }
    Ok(PendingAppend {
        tx,
        positions,
        strategy,
    })
}

/// An append's events: at least one, each valid.
fn validate_events(events: &[Event]) -> Result<()> {
    if events.is_empty() {
        return Err(Error::Invalid {
            what: "append",
            why: "at least one event is needed".into(),
        });
    }
    events.iter().try_for_each(Event::validate)
}

/// Validates an append and returns the keys its strategy takes: the
/// publishing keys, and under the advisory strategy the condition's keys.
fn validated_keys(
    strategy: AppendStrategy,
    events: &[Event],
    condition: Option<&AppendCondition>,
) -> Result<AppendKeys> {
    validate_events(events)?;
    if let Some(c) = condition {
        c.fail_if_events_match.validate()?;
    }
    let mut keys = AppendKeys::publishing(events)?;
    if strategy == AppendStrategy::AdvisoryLocks
        && let Some(c) = condition
    {
        keys = keys.merge(AppendKeys::condition(&c.fail_if_events_match)?);
        keys.check_limit("append")?;
    }
    Ok(keys)
}

/// The error of a failed condition, logged and counted. Logged at debug:
/// a refused condition is the outcome a DCB command expects under
/// contention (the caller decides again), not a fault; the counter
/// `pgonce_events_conflicts_total` shows how often.
fn refused(strategy: AppendStrategy, c: &AppendCondition, matching: Vec<i64>) -> Error {
    tracing::debug!(strategy = strategy.name(), after = ?c.after, ?matching, "append condition failed");
    metrics::counter!("pgonce_events_conflicts_total", "strategy" => strategy.name()).increment(1);
    Error::AppendConditionFailed {
        after: c.after,
        matching,
    }
}

/// SQLSTATE the one-statement functions of migration 0110 raise when the
/// transaction they would run in is not READ COMMITTED (the session's
/// `default_transaction_isolation` says otherwise): the caller then takes
/// the path that sets the isolation itself.
const NOT_READ_COMMITTED: &str = "PO110";

/// Whether `e` is [`NOT_READ_COMMITTED`].
pub(crate) fn not_read_committed(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == NOT_READ_COMMITTED)
}

/// A condition's query as pgonce.events_filter takes it: its items as a
/// JSON array of {types, tags}, or NULL for [`Query::All`].
pub(crate) fn items_json(query: &Query) -> Result<Option<serde_json::Value>> {
    match query {
        Query::All => Ok(None),
        Query::Items(items) => serde_json::to_value(items)
            .map(Some)
            .map_err(|e| Error::Invalid {
                what: "query",
                why: e.to_string(),
            }),
    }
}

/// What pgonce.events_append returns: the first positions matching the
/// condition (empty when it held) and the positions drawn (empty when not).
#[derive(Debug, sqlx::FromRow)]
struct OneStatementAppend {
    matching: Vec<i64>,
    positions: Vec<i64>,
}

/// A whole append under a lock strategy in one statement, its own
/// transaction, one round trip (pgonce.events_append, migration 0110, says
/// why it is as safe as begin + check + insert + commit). `None` when the
/// session is not at READ COMMITTED (see [`NOT_READ_COMMITTED`]): nothing
/// was done, and the caller takes the transaction path.
///
/// Unlike [`begin`], a call given up (its future dropped) after the
/// statement was sent may still commit, as any commit whose reply is lost:
/// the statement runs to its end on the server.
async fn append_one_statement(
    pool: &PgPool,
    strategy: AppendStrategy,
    notify: bool,
    events: &[Event],
    condition: Option<&AppendCondition>,
) -> Result<Option<Vec<i64>>> {
    let keys = validated_keys(strategy, events, condition)?;
    let (keys, modes) = keys.arrays();
    let channel = notify.then_some(NOTIFY_CHANNEL);
    let table_lock = strategy == AppendStrategy::TableLock;
    let after = condition.and_then(|c| c.after).unwrap_or(0);
    let tag_item = condition.and_then(|c| c.fail_if_events_match.tag_item());
    let row: std::result::Result<OneStatementAppend, sqlx::Error> = match (tag_item, events) {
        // The commonest append: one event, on the commonest condition, its
        // fields as parameters (migration 0180).
        (Some(tags), [event]) => {
            // The event's tags and the condition's travel beside its
            // data and metadata, as many as given (duplicates included).
            // Counted before the text is written.
            crate::json::check_sendable_beside(
                "event",
                crate::json::text_lengths(&event.data).stored
                    + crate::json::text_lengths(&event.metadata).stored,
                text_array_bytes(&event.tags) + text_array_bytes(tags),
            )?;
            let data = crate::json::stored(&event.data);
            let metadata = crate::json::stored(&event.metadata);
            sqlx::query_as(include_str!("sql/append_one_tag_item.sql"))
                .bind(&event.event_type)
                .bind(&event.tags)
                .bind(data)
                .bind(metadata)
                .bind(channel)
                .bind(keys)
                .bind(modes)
                .bind(table_lock)
                .bind(tags)
                .bind(after)
                .fetch_one(pool)
                .await
        }
        // The commonest condition, with the plans kept (migration 0170).
        (Some(tags), _) => {
            sqlx::query_as(include_str!("sql/append_tag_item.sql"))
                .bind(events_json(events, text_array_bytes(tags))?)
                .bind(channel)
                .bind(keys)
                .bind(modes)
                .bind(table_lock)
                .bind(tags)
                .bind(after)
                .fetch_one(pool)
                .await
        }
        (None, _) => {
            // The condition's items travel beside the events, as the JSON
            // text measured here: the parameter's length (4 bytes), jsonb's
            // version byte, the text.
            let items = match condition {
                Some(c) => items_json(&c.fail_if_events_match)?.map(|v| crate::json::stored(&v)),
                None => None,
            };
            let items_bytes = items.as_ref().map_or(0, |v| 4 + 1 + v.0.get().len());
            sqlx::query_as(include_str!("sql/append.sql"))
                .bind(events_json(events, items_bytes)?)
                .bind(channel)
                .bind(keys)
                .bind(modes)
                .bind(table_lock)
                .bind(condition.is_some())
                .bind(items)
                .bind(after)
                .fetch_one(pool)
                .await
        }
    };
    let OneStatementAppend {
        matching,
        positions,
    } = match row {
        Ok(row) => row,
        Err(e) if not_read_committed(&e) => return Ok(None),
        Err(e) => return Err(crate::json::too_large("event", e)),
    };
    match condition {
        Some(c) if !matching.is_empty() => Err(refused(strategy, c, matching)),
        _ => Ok(Some(positions)),
    }
}

/// What insert_checked.sql returns: the first positions matching the
/// condition (empty when it held) and the positions drawn (empty when not).
#[derive(Debug, sqlx::FromRow)]
struct CheckedInsert {
    matching: Vec<i64>,
    positions: Vec<i64>,
}

/// The events as one JSON array, written so that their numbers read back
/// as they were given ([`crate::json::stored`]); [`Error::Invalid`] when
/// its text, with the `beside` bytes of the condition sent in the same
/// statement, is too long to send ([`crate::json::check_sendable_beside`]),
/// counted before the text is written.
fn events_json(
    events: &[Event],
    beside: usize,
) -> Result<sqlx::types::Json<Box<serde_json::value::RawValue>>> {
    let value = serde_json::to_value(events).map_err(|e| Error::Invalid {
        what: "event",
        why: e.to_string(),
    })?;
    let text = crate::json::text_lengths(&value).stored;
    crate::json::check_sendable_beside("event", text, beside)?;
    Ok(crate::json::stored(&value))
}

/// The isolation level [`begin_locked`] opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    ReadCommitted,
    Serializable,
}

/// Opens a transaction at `isolation` that holds `keys` (ascending order)
/// and, with `table_lock`, `pgonce.events` in EXCLUSIVE mode, in one round
/// trip (begin_locked.sql). With `assign_xid` the transaction id is
/// assigned too, before any position is drawn. If a lock fails, the error is
/// returned and the session is left idle (no transaction open).
/// Cancel safe ([`crate::transaction::begin_cancel_safe`]).
pub(crate) async fn begin_locked(
    pool: &PgPool,
    isolation: Isolation,
    keys: &AppendKeys,
    assign_xid: bool,
    table_lock: bool,
) -> Result<Transaction<'static, Postgres>> {
    let sql = include_str!("sql/begin_locked.sql")
        .replace(
            "{isolation}",
            match isolation {
                Isolation::ReadCommitted => "READ COMMITTED",
                Isolation::Serializable => "SERIALIZABLE",
            },
        )
        .replace("{locks}", &keys.lock_calls(assign_xid))
        .replace(
            "{lock_table}",
            if table_lock {
                concat!(include_str!("sql/lock_table.sql"), ";")
            } else {
                ""
            },
        );
    // Trusted parts only: our SQL and integer literals.
    Ok(crate::transaction::begin_cancel_safe(pool, sql).await?)
}

/// Inserts `events` (validated, keys taken) without a condition and returns
/// their positions. With `read_later` (the serializable strategy) the insert
/// also reads the conditional appends above its lowest position (module
/// docs, "Why every append reads the conditional appends above it").
async fn insert(
    tx: &mut Transaction<'_, Postgres>,
    notify: bool,
    read_later: bool,
    events: &[Event],
) -> Result<Vec<i64>> {
    let positions: Vec<i64> = sqlx::query_scalar(include_str!("sql/insert.sql"))
        .bind(events_json(events, 0)?)
        .bind(notify.then_some(NOTIFY_CHANNEL))
        .bind(read_later)
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| crate::json::too_large("event", e))?;
    Ok(positions)
}

/// An unconditional append inside the caller's transaction: publishing keys
/// (shared), then insert. Under the serializable strategy the transaction
/// must be SERIALIZABLE, or concurrent conditional appends could not see it.
pub(crate) async fn append_in(
    tx: &mut Transaction<'_, Postgres>,
    strategy: AppendStrategy,
    notify: bool,
    events: &[Event],
) -> Result<Vec<i64>> {
    validate_events(events)?;
    if strategy == AppendStrategy::Serializable {
        let isolation: String = sqlx::query_scalar(include_str!("sql/isolation.sql"))
            .fetch_one(&mut **tx)
            .await?;
        if isolation != "serializable" {
            return Err(Error::WrongIsolation {
                strategy: strategy.name(),
                needed: "SERIALIZABLE",
                found: isolation,
            });
        }
    }
    AppendKeys::publishing(events)?.take(tx).await?;
    let read_later = strategy == AppendStrategy::Serializable;
    let positions = insert(tx, notify, read_later, events).await?;
    metrics::counter!("pgonce_events_appends_total", "strategy" => strategy.name()).increment(1);
    Ok(positions)
}

/// The pause before the `retries`-th retry of an append: a random time up
/// to 1 ms doubled per retry, at most 64 ms ("full jitter"). Appends that
/// failed together (two SERIALIZABLE transactions whose reads and writes
/// overlapped, or the two sides of a deadlock) retried at once would
/// overlap again, round after round, until their retries ran out; spread
/// out, one commits before the other reads.
fn retry_pause(retries: u32) -> Duration {
    let ceiling_micros = 1_000u64 << retries.saturating_sub(1).min(6);
    Duration::from_micros(rand::random_range(0..=ceiling_micros))
}

/// begin + commit, retrying serialization failures up to `max_retries`,
/// each after a [`retry_pause`].
pub(crate) async fn append(
    pool: &PgPool,
    strategy: AppendStrategy,
    notify: bool,
    max_retries: u32,
    events: &[Event],
    condition: Option<&AppendCondition>,
) -> Result<Appended> {
    let mut retries = 0;
    loop {
        let attempt = async {
            // The lock strategies in one round trip; the serializable one
            // needs its own isolation level, set by begin.
            if strategy != AppendStrategy::Serializable
                && let Some(positions) =
                    append_one_statement(pool, strategy, notify, events, condition).await?
            {
                return Ok(positions);
            }
            begin(pool, strategy, notify, events, condition)
                .await?
                .commit()
                .await
        };
        match attempt.await {
            Ok(positions) => {
                metrics::counter!("pgonce_events_appends_total", "strategy" => strategy.name())
                    .increment(1);
                return Ok(Appended { positions, retries });
            }
            Err(e) if e.is_retryable() && retries < max_retries => {
                retries += 1;
                metrics::counter!("pgonce_events_retries_total", "strategy" => strategy.name())
                    .increment(1);
                tracing::debug!(strategy = strategy.name(), retries, "append retried: {e}");
                tokio::time::sleep(retry_pause(retries)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random, never past the ceiling for its retry: 1 ms for the first,
    /// doubling, 64 ms from the seventh on (no overflow however many).
    #[test]
    fn retry_pauses_stay_under_their_doubling_ceiling() {
        for (retries, ceiling_ms) in [(1, 1), (2, 2), (3, 4), (7, 64), (8, 64), (u32::MAX, 64)] {
            for _ in 0..200 {
                let pause = retry_pause(retries);
                assert!(
                    pause <= Duration::from_millis(ceiling_ms),
                    "{retries}: {pause:?}"
                );
            }
        }
    }
}
