//! Reads: by query, the head, and the decision read.

use serde_json::Value;
use sqlx::PgPool;

use super::append::{AppendKeys, Isolation, begin_locked, items_json, not_read_committed};
use super::model::{Decision, Event, Query, ReadOptions, StoredEvent};
use super::query::Filter;
use crate::error::Result;

/// An event as the reads select it.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct EventRow {
    position: i64,
    #[sqlx(rename = "type")]
    event_type: String,
    tags: Vec<String>,
    data: Value,
    metadata: Value,
}

impl From<EventRow> for StoredEvent {
    fn from(row: EventRow) -> StoredEvent {
        StoredEvent {
            position: row.position,
            event: Event {
                event_type: row.event_type,
                tags: row.tags,
                data: row.data,
                metadata: row.metadata,
            },
        }
    }
}

/// A row of decide.sql: the head, and one matching event (all NULL when
/// none matches: the LEFT JOIN's one row).
#[derive(Debug, sqlx::FromRow)]
struct DecideRow {
    head: Option<i64>,
    position: Option<i64>,
    #[sqlx(rename = "type")]
    event_type: Option<String>,
    tags: Option<Vec<String>>,
    data: Option<Value>,
    metadata: Option<Value>,
}

pub(crate) async fn read(
    pool: &PgPool,
    query: &Query,
    options: ReadOptions,
) -> Result<Vec<StoredEvent>> {
    query.validate()?;
    options.validate()?;
    let filter = Filter::new(query, 3);
    let (template, from) = if options.backwards {
        (
            include_str!("sql/read_backwards.sql"),
            options.from.unwrap_or(i64::MAX),
        )
    } else {
        (include_str!("sql/read.sql"), options.from.unwrap_or(1))
    };
    let rows: Vec<EventRow> = filter
        .bind_as(
            sqlx::query_as(filter.statement(template))
                .bind(from)
                .bind(options.limit),
        )
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().map(StoredEvent::from).collect())
}

pub(crate) async fn head(pool: &PgPool) -> Result<Option<i64>> {
    Ok(sqlx::query_scalar(include_str!("sql/head.sql"))
        .fetch_one(pool)
        .await?)
}

pub(crate) async fn decide(pool: &PgPool, query: &Query) -> Result<Decision> {
    query.validate()?;
    // Waits for every in-flight append publishing an event that matches the
    // query (they hold these keys shared until they commit); appends that
    // start later draw positions above the head read next. No transaction
    // id: a read-only transaction commits without a WAL flush.
    let keys = AppendKeys::condition(query)?;
    // In one round trip (pgonce.events_decide, migration 0110): locks, then
    // the same read from a snapshot taken after them, in the statement's own
    // transaction. A session whose default isolation is not READ COMMITTED
    // takes the transaction path, which sets it.
    let (key_array, modes) = keys.arrays();
    let one: std::result::Result<Vec<DecideRow>, sqlx::Error> = match query.tag_item() {
        // The commonest query, with the plans kept (migration 0170).
        Some(tags) => {
            sqlx::query_as(include_str!("sql/decide_tag_item.sql"))
                .bind(key_array)
                .bind(modes)
                .bind(tags)
                .fetch_all(pool)
                .await
        }
        None => {
            sqlx::query_as(include_str!("sql/decide_one_statement.sql"))
                .bind(key_array)
                .bind(modes)
                .bind(items_json(query)?)
                .fetch_all(pool)
                .await
        }
    };
    let rows = match one {
        Ok(rows) => rows,
        Err(e) if not_read_committed(&e) => {
            let mut tx = begin_locked(pool, Isolation::ReadCommitted, &keys, false, false).await?;
            let filter = Filter::new(query, 1);
            let rows: Vec<DecideRow> = filter
                .bind_as(sqlx::query_as(
                    filter.statement(include_str!("sql/decide.sql")),
                ))
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            rows
        }
        Err(e) => return Err(e.into()),
    };
    let after = rows.first().and_then(|r| r.head);
    let events = rows
        .into_iter()
        .filter_map(|r| {
            Some(StoredEvent {
                position: r.position?,
                event: Event {
                    event_type: r.event_type?,
                    tags: r.tags.unwrap_or_default(),
                    data: r.data.unwrap_or(Value::Null),
                    metadata: r.metadata.unwrap_or(Value::Null),
                },
            })
        })
        .collect();
    Ok(Decision { events, after })
}
