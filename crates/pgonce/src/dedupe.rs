//! Once per key, for effects that are not state transitions (pattern P4,
//! against an SQS worker's duplicate execution).
//!
//! `UPDATE accounts SET balance = balance + $1` moves the value on every
//! delivery; no status column can guard it. Two tools:
//!
//! * **processed-message keys** ([`mark_processed`], [`apply_once`]): the
//!   message id is inserted into `pgonce.processed_messages` in the same
//!   transaction as the effect. A duplicate delivery inserts nothing and skips
//!   the effect; a concurrent one waits on the key's unique index until the
//!   first commits (then skips) or rolls back (then applies). Needs the
//!   effect to be a write in the same database and transaction.
//! * **idempotency keys** for requests ([`acquire`], [`finish`],
//!   [`release`]): the first use records the request's fingerprint and holds
//!   the key; a retry with the same key gets the stored response
//!   ([`Acquired::Replay`]); a different request under the same key is
//!   [`Error::IdempotencyMismatch`]; a request while the holder still works is
//!   [`Error::IdempotencyInProgress`]; a holder that died is recovered once its
//!   hold expires (the next identical request takes the key over, and the old
//!   holder's [`finish`] then fails with [`Error::LeaseLost`]).
//!
//! Keys, consumers and scopes are non-empty text of at most
//! [`MAX_KEY_BYTES`] without NUL, compared byte for byte: the same text in
//! two Unicode normalisation forms (`é` as one code point, or as `e` and a
//! combining accent) is two keys. Normalise keys before use if clients may
//! send either form.
//!
//! [`Collector`] deletes keys older than their retention;
//! [`crate::maintenance`] runs the same deletes beside the library's other
//! cleaners, for a server that runs one maintenance loop for everything.
//!
//! # Waits
//!
//! A concurrent delivery's [`mark_processed`] waits for the first one's
//! transaction, and [`acquire`], [`finish`] and [`release`] wait for a
//! transaction writing the same key, within the `lock_timeout` the session
//! inherited if there is one (an operator's `ALTER ROLE ... SET
//! lock_timeout`): past it [`Error::LockNotAvailable`], nothing written
//! (the message is then redelivered, or the request retried, and meets
//! what that transaction left). `statement_timeout` bounds every statement:
//! past it [`Error::QueryCanceled`]. The [`Collector`] never waits for a
//! key: it skips locked ones.
//!
//! # Isolation
//!
//! [`mark_processed`] runs in the caller's transaction. Under READ COMMITTED
//! a concurrent duplicate waits and then sees the conflict (returns `false`).
//! Under REPEATABLE READ or SERIALIZABLE the waiting duplicate gets SQLSTATE
//! 40001 ([`Error::SerializationFailure`]): retry the transaction, and the
//! retry returns `false`.
//!
//! [`acquire`] commits the hold on a connection of its own, and says why
//! it took nothing from a READ COMMITTED transaction, whatever the
//! database's default isolation level; [`finish`] and
//! [`release`] run in the caller's transaction. Under REPEATABLE READ or
//! SERIALIZABLE a transaction whose snapshot predates the hold (begun and
//! read from before [`acquire`], as a transaction per request is) cannot
//! see it, and gets [`Error::SerializationFailure`] rather than
//! [`Error::LeaseLost`]: the hold is still its own, and the transaction's
//! retry sees it (migration 0200). Only a hold that is really lost gives
//! [`Error::LeaseLost`], at every isolation level.
//!
//! The [`Collector`] deletes in READ COMMITTED transactions of its own,
//! whatever the database's default: it skips locked keys and re-checks the
//! rest, and under a stricter level a key changed since its statement's
//! snapshot would fail the pass with 40001.
//!
//! # Cancel safety
//!
//! A caller may drop any of these futures at any await (its own timeout,
//! a `select!`, a client that hung up, a task aborted at shutdown). Once a
//! statement was sent the server runs it whether or not anyone reads its
//! answer, so what a dropped call leaves is:
//!
//! * [`acquire`]: nothing. It runs on one pooled connection, and not at
//!   all if its caller is gone by the time a connection is free; a drop
//!   once its statement was sent hands it to a task of its own, and a
//!   hold taken for a caller that is gone is given back (as [`release`] would) before that connection serves anyone
//!   else, and the connection goes back to the pool outside any
//!   transaction, its row locks gone. Only when that release fails too
//!   (the connection or the server died, the runtime shut down) is the key
//!   left in progress, until the hold runs out, as for a holder that died.
//! * [`apply_once`]: the mark and the effect both, or neither: they are one
//!   transaction, rolled back unless its COMMIT was sent.
//! * [`mark_processed`], [`finish`], [`release`]: one statement each, on
//!   the executor given. On a pool it either ran or did not; a [`finish`]
//!   whose answer was never read may have stored the response (a retried
//!   [`acquire`] then replays it). In a transaction of the caller's, whether
//!   it ran is unknown to the caller (a statement sent runs before the
//!   transaction's next one): roll the transaction back, as after an
//!   error, rather than commit it.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::{Connection, PgConnection, PgExecutor, PgPool, Postgres, Transaction};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{Error, Result};

/// The longest consumer, message id, idempotency scope or idempotency key,
/// in bytes of UTF-8. Each pair is one entry of a unique btree index,
/// which holds at most 2704 bytes (a third of an 8 kB page) once
/// compressed: past it an insert fails with SQLSTATE 54000, depending on
/// how well the text compresses, and inside the caller's transaction the
/// error aborts it. Two of these fit whatever their content. SQS message
/// ids are at most 100 bytes; idempotency keys are usually a UUID.
pub const MAX_KEY_BYTES: usize = 1024;

/// Refused before anything reaches the database: empty, longer than
/// [`MAX_KEY_BYTES`], or holding NUL.
fn check_key(what: &'static str, s: &str) -> Result<()> {
    crate::text::check_key(what, s, MAX_KEY_BYTES)
}

/// Records that `consumer` processed `message_id`, inside `tx`. `true` the
/// first time: apply the effect in the same transaction and commit. `false`
/// if it was already processed (committed by an earlier delivery): skip the
/// effect. Rolling `tx` back forgets the mark together with the effect.
pub async fn mark_processed(
    tx: &mut Transaction<'_, Postgres>,
    consumer: &str,
    message_id: &str,
) -> Result<bool> {
    check_key("consumer", consumer)?;
    check_key("message id", message_id)?;
    let done = sqlx::query(include_str!("dedupe/sql/mark_processed.sql"))
        .bind(consumer)
        .bind(message_id)
        .execute(&mut **tx)
        .await?;
    let first = done.rows_affected() == 1;
    if !first {
        metrics::counter!("pgonce_dedupe_duplicates_total").increment(1);
        tracing::debug!(consumer, message_id, "duplicate message skipped");
    }
    Ok(first)
}

/// Applies `effect` once per (`consumer`, `message_id`): in one READ
/// COMMITTED transaction, marks the message processed and, the first time
/// only, runs `effect` on the same connection, then commits. `Ok(None)` for a
/// duplicate. If `effect` fails, the transaction rolls back, so the message
/// can be processed again.
pub async fn apply_once<T>(
    pool: &PgPool,
    consumer: &str,
    message_id: &str,
    effect: impl AsyncFnOnce(&mut PgConnection) -> Result<T>,
) -> Result<Option<T>> {
    let mut tx = crate::begin(pool, crate::IsolationLevel::ReadCommitted).await?;
    if !mark_processed(&mut tx, consumer, message_id).await? {
        tx.rollback().await?;
        return Ok(None);
    }
    let out = effect(&mut tx).await?;
    tx.commit().await?;
    Ok(Some(out))
}

/// The fingerprint of a request: SHA-256 of its JSON value, serialised
/// with every object's keys in sorted order. Two requests count as the
/// same request when they serialise to the same JSON value: the order in
/// which a map gives its keys (a `HashMap`, whose order differs from
/// process to process; a body parsed from a client that orders its keys
/// otherwise) does not matter, as it does not in JSON. Any other
/// difference, an array's order included, makes another request.
/// [`Error::Invalid`] when the request does not serialise to a JSON value
/// (a map with keys that are not strings or numbers, an integer past
/// 64 bits).
pub fn fingerprint(request: &impl Serialize) -> Result<Vec<u8>> {
    let invalid = |e: serde_json::Error| Error::Invalid {
        what: "request",
        why: format!("cannot serialise for a fingerprint: {e}"),
    };
    let mut value = serde_json::to_value(request).map_err(invalid)?;
    // The workspace's serde_json keeps objects in insertion order.
    value.sort_all_objects();
    let bytes = serde_json::to_vec(&value).map_err(invalid)?;
    Ok(Sha256::digest(&bytes).to_vec())
}

/// The hold on an idempotency key by the request that is processing it.
/// Pass it to [`finish`] (store the response) or [`release`] (give up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyHold {
    /// The scope the key belongs to, as passed to [`acquire`].
    pub scope: String,
    /// The idempotency key, unique within its scope.
    pub key: String,
    /// Identifies this hold: [`finish`] and [`release`] succeed only while the
    /// key is still held under this token.
    pub token: Uuid,
    /// When the hold runs out (database clock); after it, another request may
    /// take the key over and this hold is lost.
    pub held_until: OffsetDateTime,
    /// `false` when this hold recovered a key whose previous holder died.
    pub first_use: bool,
    /// The transaction that took the hold (its 64-bit id,
    /// `pg_current_xact_id()`). [`finish`] and [`release`] in a transaction
    /// whose snapshot predates it cannot see the hold: they fail with
    /// [`Error::SerializationFailure`] (retry the transaction) rather than
    /// [`Error::LeaseLost`]. 0 when unknown (a hold rebuilt from its token):
    /// such a hold is lost wherever it is not seen. So is one naming a
    /// transaction the server has not reached (an acquire committed with
    /// `synchronous_commit = off` and lost in a crash: recovery hands the
    /// id out again later), one naming an id no server hands out (negative,
    /// or whose low 32 bits are 0, 1 or 2: migration 0300), and one whose
    /// transaction rolled back, even under a snapshot taken while it was
    /// open (migration 0250).
    pub acquired_in: i64,
}

impl KeyHold {
    fn lost(&self) -> Error {
        metrics::counter!("pgonce_dedupe_hold_lost_total").increment(1);
        tracing::warn!(scope = %self.scope, key = %self.key, "idempotency key hold lost");
        Error::LeaseLost {
            resource: format!("idempotency key {}/{}", self.scope, self.key),
        }
    }
}

/// The outcome of [`acquire`].
#[derive(Debug, Clone, PartialEq)]
pub enum Acquired {
    /// This request holds the key: process it, then [`finish`].
    Process(KeyHold),
    /// The same request was already processed: return this response.
    Replay(Value),
}

/// A hold `dedupe/sql/key_acquire.sql` took: on a new key (`inserted`) or
/// on one whose earlier holder's hold ran out.
#[derive(sqlx::FromRow)]
struct HeldRow {
    hold_token: Uuid,
    held_until: OffsetDateTime,
    inserted: bool,
    acquired_in: i64,
}

/// A key someone else holds or finished, as `dedupe/sql/key_read.sql`
/// returns it.
#[derive(sqlx::FromRow)]
struct KeyRow {
    fingerprint: Vec<u8>,
    status: String,
    response: Option<Value>,
}

/// The longest hold [`acquire`] takes: a year. The hold's end is written,
/// committed, then read back, and a timestamp past year 9999 cannot be read
/// back (sqlx's `time` decoding stops there): a longer hold would commit a
/// key held by nobody until then, and every retry would find it in
/// progress. Refused before anything is written instead.
pub const MAX_HOLD: Duration = Duration::from_secs(365 * 24 * 3600);

/// The shortest hold [`acquire`] takes: a millisecond. The hold's end is
/// the transaction's time plus an `interval`, which holds whole
/// microseconds: a hold under half a microsecond would end as it was
/// taken, and the next identical request would take the key over while
/// its holder worked on it. Refused before anything is written.
pub const MIN_HOLD: Duration = crate::duration::SHORTEST_LEASE;

/// Uses idempotency key `key` in `scope` for a request with `fingerprint`
/// (see [`fingerprint`]), holding it for `hold_for` ([`MIN_HOLD`] to
/// [`MAX_HOLD`]) if it is new or its previous holder's hold expired. See
/// the module docs for the outcomes. A fingerprint empty or past
/// [`crate::json::MAX_SENT_JSON_BYTES`] is [`Error::Invalid`], nothing
/// written.
///
/// Cancel safe: a call dropped at any await leaves no hold behind (see
/// "Cancel safety" in the module docs).
pub async fn acquire(
    pool: &PgPool,
    scope: &str,
    key: &str,
    fingerprint: &[u8],
    hold_for: Duration,
) -> Result<Acquired> {
    check_key("idempotency scope", scope)?;
    check_key("idempotency key", key)?;
    crate::duration::check_within("idempotency hold", hold_for, MIN_HOLD, MAX_HOLD)?;
    if fingerprint.is_empty() {
        return Err(Error::invalid(
            "idempotency fingerprint",
            "must not be empty",
        ));
    }
    // Sent beside the scope and key in one statement: past PostgreSQL's
    // 1 GiB message the server dropped the connection.
    if fingerprint.len() > crate::json::MAX_SENT_JSON_BYTES {
        return Err(Error::invalid(
            "idempotency fingerprint",
            format!(
                "{} bytes, past the {} one statement sends PostgreSQL (which takes a \
                 message of at most 1 GiB): pass a hash of the request (dedupe::fingerprint)",
                fingerprint.len(),
                crate::json::MAX_SENT_JSON_BYTES
            ),
        ));
    }
    let (scope, key, fingerprint) = (scope.to_owned(), key.to_owned(), fingerprint.to_owned());
    // On one connection, handed to a task if dropped: a hold taken for a
    // caller who stopped waiting (its future dropped once the upsert was sent,
    // which the server runs regardless) is given back at once, before the
    // connection serves anyone else. Left, it would turn every retry of
    // the request away as in progress until it ran out.
    crate::transaction::answered_or_given_back(
        pool,
        move |conn| {
            Box::pin(async move { acquire_on(conn, &scope, &key, &fingerprint, hold_for).await })
        },
        |conn, acquired| {
            Box::pin(async move {
                if let Acquired::Process(hold) = acquired {
                    give_back(conn, &hold).await;
                }
            })
        },
    )
    .await
}

/// Releases a hold [`acquire`] took for a caller that stopped waiting.
async fn give_back(conn: &mut PgConnection, hold: &KeyHold) {
    match release(&mut *conn, hold).await {
        Ok(()) => tracing::debug!(
            scope = %hold.scope,
            key = %hold.key,
            "idempotency key hold given back: its caller stopped waiting"
        ),
        Err(e) => tracing::warn!(
            scope = %hold.scope,
            key = %hold.key,
            error = %e,
            "idempotency key hold taken for a caller that stopped waiting \
             not given back: the key is in progress until the hold runs out"
        ),
    }
}

/// [`acquire`]'s statements, on `conn`, outside any transaction.
async fn acquire_on(
    conn: &mut PgConnection,
    scope: &str,
    key: &str,
    fingerprint: &[u8],
    hold_for: Duration,
) -> Result<Acquired> {
    // The upsert alone first: a new key, or one whose holder's hold ran
    // out, is taken in one statement, the commonest case. That statement
    // is a transaction at the database's default isolation level: under a
    // stricter one than READ COMMITTED, meeting a key another request
    // wrote since its snapshot is a serialization failure, and the READ
    // COMMITTED transaction below says what happened instead.
    match upsert_key(&mut *conn, scope, key, fingerprint, hold_for).await {
        Ok(Some(row)) => return Ok(taken(scope, key, row)),
        Ok(None) => {}
        Err(e) if e.is_retryable() => {}
        Err(e) => return Err(e),
    }
    // The key was there and not taken: why is read in one READ COMMITTED
    // transaction with the upsert tried again, so that the key cannot
    // change between the two. When the upsert takes nothing, its ON
    // CONFLICT DO UPDATE has still locked the row it conflicted with (as
    // it does whether or not its WHERE holds), and the read, with a
    // snapshot taken after that lock, sees that very row: nobody can
    // collect, release or finish it before this transaction ends. Run on
    // their own, the key could be collected and made again between them,
    // and the read find nothing, round after round. (sqlx's BEGIN on a
    // bare connection leaves it inside a transaction if dropped midway:
    // not here, in a task nobody drops.)
    let mut tx = conn
        .begin_with(crate::IsolationLevel::ReadCommitted.begin())
        .await?;
    if let Some(row) = upsert_key(&mut *tx, scope, key, fingerprint, hold_for).await? {
        tx.commit().await?;
        return Ok(taken(scope, key, row));
    }
    // The row the upsert locked: there is one (see above).
    let KeyRow {
        fingerprint: stored,
        status,
        response,
    } = sqlx::query_as(include_str!("dedupe/sql/key_read.sql"))
        .bind(scope)
        .bind(key)
        .fetch_one(&mut *tx)
        .await?;
    // Nothing was written: ending the transaction only lets the row go.
    tx.commit().await?;
    if stored != fingerprint {
        metrics::counter!("pgonce_dedupe_mismatches_total").increment(1);
        tracing::warn!(scope, key, "idempotency key reused for a different request");
        return Err(Error::IdempotencyMismatch { key: key.into() });
    }
    if status == "done" {
        metrics::counter!("pgonce_dedupe_replays_total").increment(1);
        return Ok(Acquired::Replay(response.unwrap_or(Value::Null)));
    }
    Err(Error::IdempotencyInProgress { key: key.into() })
}

/// Takes the key if it is new or its holder's hold ran out (and locks its
/// row either way, for the rest of `db`'s transaction); `None` when it was
/// not taken.
async fn upsert_key<'c>(
    db: impl PgExecutor<'c>,
    scope: &str,
    key: &str,
    fingerprint: &[u8],
    hold_for: Duration,
) -> Result<Option<HeldRow>> {
    Ok(sqlx::query_as(include_str!("dedupe/sql/key_acquire.sql"))
        .bind(scope)
        .bind(key)
        .bind(fingerprint)
        .bind(hold_for.as_secs_f64())
        .fetch_optional(db)
        .await?)
}

/// The hold of a key [`upsert_key`] took.
fn taken(scope: &str, key: &str, row: HeldRow) -> Acquired {
    let HeldRow {
        hold_token: token,
        held_until,
        inserted,
        acquired_in,
    } = row;
    if !inserted {
        tracing::warn!(scope, key, "idempotency key recovered from a dead holder");
        metrics::counter!("pgonce_dedupe_keys_recovered_total").increment(1);
    }
    Acquired::Process(KeyHold {
        scope: scope.into(),
        key: key.into(),
        token,
        held_until,
        first_use: inserted,
        acquired_in,
    })
}

/// Stores `response` for the held key, in `db` (pass the transaction that
/// wrote the request's effects, so both commit together). [`Error::LeaseLost`]
/// if the hold expired and another request took the key over (or the key
/// was released or collected).
///
/// The response is stored as the JSON text it serialises to, and a replay
/// ([`Acquired::Replay`]) is that text parsed: the same value, serialising
/// to the same text (numbers and the order of object keys as given).
/// [`Error::Invalid`], before anything is written, for a response that
/// could not be read back or queried ([`crate::json::check_storable`]),
/// or whose JSON text is past what one statement sends PostgreSQL
/// ([`crate::json::MAX_SENT_JSON_BYTES`]).
///
/// Under REPEATABLE READ or SERIALIZABLE, a transaction whose snapshot was
/// taken before the hold (begun, and read from, before [`acquire`]) cannot
/// see it: [`Error::SerializationFailure`], and the transaction is aborted.
/// Run it again: its fresh snapshot sees the hold.
pub async fn finish<'c>(db: impl PgExecutor<'c>, hold: &KeyHold, response: &Value) -> Result<()> {
    crate::json::check_storable("idempotency response", response)?;
    // The hold's scope and key travel beside the text (a hold's fields
    // are public: their length is whatever the caller put there). Counted
    // before the text is written.
    crate::json::check_sendable_beside(
        "idempotency response",
        crate::json::text_lengths(response).compact,
        hold.scope.len() + hold.key.len(),
    )?;
    // As text: a replay is this text, parsed (see key_finish.sql).
    let text = response.to_string();
    let done: Option<i32> = sqlx::query_scalar(include_str!("dedupe/sql/key_finish.sql"))
        .bind(&hold.scope)
        .bind(&hold.key)
        .bind(hold.token)
        .bind(text)
        .bind(hold.acquired_in)
        .fetch_optional(db)
        .await?;
    if done.is_none() {
        return Err(hold.lost());
    }
    Ok(())
}

/// Gives the key up (the request failed in a way worth retrying): the next
/// use starts afresh. [`Error::LeaseLost`] if it was taken over meanwhile;
/// [`Error::SerializationFailure`] under a snapshot older than the hold, as
/// for [`finish`].
pub async fn release<'c>(db: impl PgExecutor<'c>, hold: &KeyHold) -> Result<()> {
    let done: Option<i32> = sqlx::query_scalar(include_str!("dedupe/sql/key_release.sql"))
        .bind(&hold.scope)
        .bind(&hold.key)
        .bind(hold.token)
        .bind(hold.acquired_in)
        .fetch_optional(db)
        .await?;
    if done.is_none() {
        return Err(hold.lost());
    }
    Ok(())
}

/// Settings of the [`Collector`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectorConfig {
    /// Pause between passes of [`Collector::run`]. Default 60 s; non-zero.
    pub interval: Duration,
    /// How long processed-message keys are kept. Default 7 days. Must exceed
    /// the longest time a message can be redelivered after (queue retention),
    /// or a late duplicate is applied again.
    pub processed_retention: Duration,
    /// How long idempotency keys are kept after first use. Default 24 h (what
    /// clients are told a retry may take). An abandoned hold is only
    /// collected once it expired, too.
    pub key_retention: Duration,
    /// Rows deleted per statement. Default 1000; at least 1.
    pub batch_size: i64,
}

impl Default for CollectorConfig {
    fn default() -> Self {
        CollectorConfig {
            interval: Duration::from_secs(60),
            processed_retention: Duration::from_secs(7 * 24 * 3600),
            key_retention: Duration::from_secs(24 * 3600),
            batch_size: 1000,
        }
    }
}

/// What one collection pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CollectCounts {
    /// Processed-message keys deleted (older than
    /// [`CollectorConfig::processed_retention`]).
    pub processed_messages: u64,
    /// Idempotency keys deleted (older than [`CollectorConfig::key_retention`]).
    pub idempotency_keys: u64,
}

/// Garbage-collects processed-message keys and idempotency keys.
#[derive(Debug, Clone)]
pub struct Collector {
    pool: PgPool,
    config: CollectorConfig,
}

impl Collector {
    /// Validates `config` (each retention at most
    /// [`MAX_RETENTION`](crate::maintenance::MAX_RETENTION)).
    pub fn new(pool: PgPool, config: CollectorConfig) -> Result<Collector> {
        crate::service::check_config("collector config", config.interval, config.batch_size)?;
        crate::service::check_retention("collector config", config.processed_retention)?;
        crate::service::check_retention("collector config", config.key_retention)?;
        Ok(Collector { pool, config })
    }

    /// One pass: deletes everything past its retention, batch by batch.
    pub async fn run_once(&self) -> Result<CollectCounts> {
        let processed = self
            .delete_all(
                include_str!("dedupe/sql/collect_processed.sql"),
                self.config.processed_retention,
            )
            .await?;
        let keys = self
            .delete_all(
                include_str!("dedupe/sql/collect_keys.sql"),
                self.config.key_retention,
            )
            .await?;
        metrics::counter!("pgonce_dedupe_collected_total").increment(processed + keys);
        Ok(CollectCounts {
            processed_messages: processed,
            idempotency_keys: keys,
        })
    }

    async fn delete_all(&self, sql: &'static str, retention: Duration) -> Result<u64> {
        let mut total = 0;
        loop {
            let n = crate::transaction::read_committed(&self.pool, async |conn| {
                sqlx::query(sql)
                    .bind(retention.as_secs_f64())
                    .bind(self.config.batch_size)
                    .execute(conn)
                    .await
            })
            .await?
            .rows_affected();
            total += n;
            if (n as i64) < self.config.batch_size {
                return Ok(total);
            }
        }
    }

    /// Runs a pass every `interval` until `shutdown` completes. A failed
    /// pass is counted and logged (the first, then a line a minute at most,
    /// then the recovery: [`crate::service`]).
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        crate::service::run_every("dedupe collector", self.config.interval, shutdown, || {
            self.run_once()
        })
        .await;
    }
}
