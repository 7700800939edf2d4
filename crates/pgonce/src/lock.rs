//! Transaction-level advisory locks with 64-bit keys.
//!
//! A transaction-level advisory lock (`pg_advisory_xact_lock`) is released by
//! COMMIT or ROLLBACK and by nothing else: there is no unlock function, so a
//! crashed or erroring worker can never leak one. Called outside a
//! transaction, the same function takes the lock for the implicit
//! one-statement transaction and drops it when the statement returns: it
//! protects nothing, silently. Every function here therefore takes an open
//! [`sqlx::Transaction`], so that mistake does not compile:
//!
//! ```compile_fail
//! # async fn f(pool: sqlx::PgPool) -> pgonce::Result<()> {
//! let key = pgonce::LockKey::new("entity", "42")?;
//! pgonce::lock::lock(&pool, key).await?; // a pool is not a transaction
//! # Ok(()) }
//! ```
//!
//! ```compile_fail
//! # async fn f(mut conn: sqlx::PgConnection) -> pgonce::Result<()> {
//! let key = pgonce::LockKey::new("entity", "42")?;
//! pgonce::lock::lock(&mut conn, key).await?; // nor is a bare connection
//! # Ok(()) }
//! ```
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> pgonce::Result<()> {
//! let mut tx = pgonce::begin(&pool, pgonce::IsolationLevel::ReadCommitted).await?;
//! pgonce::lock::lock(&mut tx, pgonce::LockKey::new("entity", "42")?).await?;
//! // ... the short critical section ...
//! tx.commit().await?; // releases the lock
//! # Ok(()) }
//! ```
//!
//! # How long a lock is waited for
//!
//! [`lock`] and [`lock_many`] wait as long as it takes, [`lock_timeout`] as
//! long as it is told ([`Error::LockTimeout`] after that), whatever
//! `lock_timeout` the session inherited (an operator's `ALTER ROLE ... SET
//! lock_timeout`): each sets its own for its lock statement alone and
//! restores the session's after it. `statement_timeout` still bounds every
//! wait, as it bounds every statement: it is the operator's ceiling, and
//! none of these lifts it. A wait it ends fails with
//! [`Error::QueryCanceled`] (PostgreSQL's SQLSTATE 57014, "canceling
//! statement due to statement timeout"), not [`Error::LockTimeout`]. After
//! any of the three the caller's transaction is aborted: roll it back
//! (dropping it does). Only [`lock_timeout`]'s own bound leaves it usable:
//! that one timeout is caught on the server, inside the wait's
//! subtransaction, so that nothing is left for the client to undo even if
//! it stops waiting for the answer.
//!
//! # Session-level locks, for comparison only
//!
//! `pg_advisory_lock` holds its lock until `pg_advisory_unlock` or the end of
//! the session. Held across slow work, it pins a pooled connection for that
//! whole time, so in-flight work is capped by the pool size, and a forgotten
//! unlock leaks the lock to whoever gets the connection next. pgonce offers
//! no API for it; `pgonce race guard` and `pgonce bench guard` measure it
//! as the baseline it is.
//!
//! # Cancel safety
//!
//! Each function is one statement in the caller's transaction. Dropped (a
//! timeout around it, a `select!`), that statement still runs on the
//! server: the lock may be granted after the caller stopped waiting, and is
//! then held until the transaction ends. Roll the transaction back, or
//! drop it: sqlx sends its ROLLBACK when the connection is next used, which
//! for a pooled connection is as it goes back to the pool, once the wait
//! has ended. A transaction on a connection of the caller's own keeps a
//! granted lock until that connection is used again. [`lock_timeout`]
//! leaves the transaction usable either way (see there); after [`lock`],
//! [`lock_many`] or [`try_lock`] the caller does not know whether it holds
//! the lock, so it must not go on as if it did.

use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{FromRow, Postgres, Transaction};

use crate::error::{Error, Result};

/// The documented SQL derivation of [`LockKey::new`]: one row, one `bigint`
/// column `key`, for namespace `$1` and key `$2` (both `text`). Lets any
/// client, a migration or a `psql` session compute the same key.
pub const DERIVE_KEY_SQL: &str = include_str!("lock/sql/derive_key.sql");

/// A 64-bit advisory lock key, derived from a namespace and a key by
/// [`LockKey::new`].
///
/// The derivation is stable and documented so any client can compute the
/// same number:
///
/// ```text
/// key = first 8 bytes, big-endian, signed, of
///       SHA-256( utf8(namespace) || 0x00 || utf8(key) )
/// ```
///
/// In SQL (PostgreSQL 11 or newer), [`DERIVE_KEY_SQL`], with the namespace
/// as `$1` and the key as `$2`:
///
/// ```sql
/// SELECT ('x' || left(encode(sha256(
///            convert_to($1, 'UTF8') || '\x00'::bytea || convert_to($2, 'UTF8')
///        ), 'hex'), 16))::bit(64)::bigint AS key
/// ```
///
/// Neither the namespace nor the key may contain NUL (PostgreSQL's `text`
/// cannot hold it, so no SQL client could compute such a key), and the
/// namespace may not be empty. So every key [`LockKey::new`] accepts is one
/// any client can compute, and the byte string splits one way only: keys of
/// different namespaces never coincide except by a SHA-256 prefix collision
/// (about 2^-64 per pair). To find the lock in
/// `pg_locks`: `locktype = 'advisory' AND objsubid = 1 AND
/// (classid::bigint << 32 | objid::bigint) = key`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockKey(i64);

impl LockKey {
    /// Derives the key of `key` in `namespace` (see the type docs).
    pub fn new(namespace: &str, key: &str) -> Result<LockKey> {
        if namespace.is_empty() || namespace.contains('\0') {
            return Err(Error::Invalid {
                what: "lock namespace",
                why: "must be non-empty and contain no NUL character".into(),
            });
        }
        if key.contains('\0') {
            return Err(Error::Invalid {
                what: "lock key",
                why: "must contain no NUL character (SQL text cannot hold it)".into(),
            });
        }
        let mut hash = Sha256::new();
        hash.update(namespace.as_bytes());
        hash.update([0u8]);
        hash.update(key.as_bytes());
        let digest = hash.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        Ok(LockKey(i64::from_be_bytes(first)))
    }

    /// A key given as a number, for locks shared with code that computes its
    /// own keys.
    pub const fn from_raw(key: i64) -> LockKey {
        LockKey(key)
    }

    /// The number passed to `pg_advisory_xact_lock`.
    pub const fn as_i64(self) -> i64 {
        self.0
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LockKey({})", self.0)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Waits as long as it takes for the lock, and holds it until `tx` ends.
/// The `lock_timeout` the session inherited (an operator's `ALTER ROLE ...
/// SET lock_timeout`) does not cut the wait short; it is lifted for the
/// lock statement alone and applies again to the statements after it
/// (see `lock/sql/lock_many.sql`, the statement of [`lock_many`] run here
/// for the one key). For a bounded wait, [`lock_timeout`].
pub async fn lock(tx: &mut Transaction<'_, Postgres>, key: LockKey) -> Result<()> {
    lock_many(tx, [key]).await
}

/// Takes the lock if nobody holds it; never waits. `true` when taken (held
/// until `tx` ends).
pub async fn try_lock(tx: &mut Transaction<'_, Postgres>, key: LockKey) -> Result<bool> {
    Ok(sqlx::query_scalar(include_str!("lock/sql/try_lock.sql"))
        .bind(key.as_i64())
        .fetch_one(&mut **tx)
        .await?)
}

/// The longest bounded wait for a lock: PostgreSQL's `lock_timeout` is an
/// `int` of milliseconds, about 24.8 days. A longer wait would be cut to
/// it without a word; [`lock_timeout`] and a [`crate::Guard`]'s
/// `lock_timeout` refuse one instead.
pub const MAX_LOCK_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// Refuses a bounded wait PostgreSQL's `lock_timeout` cannot hold: longer
/// than [`MAX_LOCK_TIMEOUT`], or shorter than `min`.
pub(crate) fn check_lock_timeout(
    what: &'static str,
    timeout: Duration,
    min: Duration,
) -> Result<()> {
    crate::duration::check_within(what, timeout, min, MAX_LOCK_TIMEOUT)
}

/// `timeout` as the milliseconds `lock_timeout` takes, rounded up (0 there
/// would mean no timeout at all). Bounded by [`check_lock_timeout`] first.
pub(crate) fn lock_timeout_millis(timeout: Duration) -> u128 {
    timeout
        .as_nanos()
        .div_ceil(1_000_000)
        .clamp(1, i32::MAX as u128)
}

/// Waits at most `timeout` for the lock, rounded up to a whole millisecond
/// (at least 1 ms, PostgreSQL's unit); [`Error::LockTimeout`] after that.
/// A `timeout` past [`MAX_LOCK_TIMEOUT`] is [`Error::Invalid`], before any
/// statement.
///
/// The wait runs in a subtransaction with a local `lock_timeout`, which the
/// server rolls back when the wait runs out: `tx` stays usable and keeps
/// its earlier locks and writes, and the session's own `lock_timeout` is in
/// force again either way. One round trip (`lock/sql/lock_timeout.sql`),
/// and nothing for the client to undo after it: a caller that gives up the
/// call (its own timeout around it, a `select!`) leaves `tx` as the server
/// then finishes the wait, usable, holding the lock if it was granted.
/// Other errors of the wait (a deadlock, a cancel, `statement_timeout`)
/// abort `tx`, as they would any statement.
pub async fn lock_timeout(
    tx: &mut Transaction<'_, Postgres>,
    key: LockKey,
    timeout: Duration,
) -> Result<()> {
    lock_timeout_reporting_isolation(tx, key, timeout)
        .await
        .map(drop)
}

/// [`lock_timeout`], returning `tx`'s isolation level as the lock's
/// statement reports it (`current_setting('transaction_isolation')`, lower
/// case), in the same round trip.
pub(crate) async fn lock_timeout_reporting_isolation(
    tx: &mut Transaction<'_, Postgres>,
    key: LockKey,
    timeout: Duration,
) -> Result<String> {
    check_lock_timeout("lock timeout", timeout, Duration::ZERO)?;
    let sql = LOCK_TIMEOUT
        .replace("{key}", &key.as_i64().to_string())
        .replace("{millis}", &lock_timeout_millis(timeout).to_string());
    let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .fetch_one(&mut **tx)
        .await?;
    match Waited::from_row(&row)? {
        Waited {
            held: true,
            isolation,
        } => Ok(isolation),
        Waited { held: false, .. } => Err(Error::LockTimeout {
            key,
            waited: timeout,
        }),
    }
}

/// The row of `lock/sql/lock_timeout.sql`.
#[derive(sqlx::FromRow)]
struct Waited {
    /// Whether the transaction holds the lock after the bounded wait.
    held: bool,
    /// The transaction's isolation level, lower case.
    isolation: String,
}

/// `lock/sql/lock_timeout.sql` without its comment lines, as sent.
static LOCK_TIMEOUT: LazyLock<String> =
    LazyLock::new(|| without_comments(include_str!("lock/sql/lock_timeout.sql")));

/// `sql` without its comment lines: the text of a multi-statement message
/// (sent as simple query, whose text is not prepared once but sent each
/// time), kept short on the wire.
pub(crate) fn without_comments(sql: &str) -> String {
    sql.lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Takes several locks in one statement, in ascending key order and each key
/// once, so two callers locking overlapping sets can never deadlock on each
/// other. Held until `tx` ends. Waits as long as it takes, as [`lock`]
/// does: the session's `lock_timeout` is lifted for this one statement and
/// applies again after it (see `lock/sql/lock_many.sql`).
pub async fn lock_many(
    tx: &mut Transaction<'_, Postgres>,
    keys: impl IntoIterator<Item = LockKey>,
) -> Result<()> {
    let keys = sorted_unique(keys);
    if keys.is_empty() {
        return Ok(());
    }
    take_sorted(tx, keys).await.map(drop)
}

/// [`lock`], returning `tx`'s isolation level as the lock's statement
/// reports it (`current_setting('transaction_isolation')`, lower case), in
/// the same round trip.
pub(crate) async fn lock_reporting_isolation(
    tx: &mut Transaction<'_, Postgres>,
    key: LockKey,
) -> Result<String> {
    take_sorted(tx, vec![key.as_i64()]).await
}

/// Runs `lock/sql/lock_many.sql` for `keys` (sorted ascending, free of
/// duplicates, not empty) and returns the isolation level it reports.
async fn take_sorted(tx: &mut Transaction<'_, Postgres>, keys: Vec<i64>) -> Result<String> {
    let row = sqlx::query(LOCK_MANY_SQL)
        .bind(keys)
        .fetch_one(&mut **tx)
        .await?;
    Ok(Locked::from_row(&row)?.isolation)
}

/// What `lock/sql/lock_many.sql` reports besides taking its locks.
#[derive(sqlx::FromRow)]
struct Locked {
    /// The transaction's isolation level, lower case.
    isolation: String,
}

/// `lock/sql/lock_many.sql`: takes the advisory keys `$1` (a `bigint[]`,
/// sorted ascending, free of duplicates), waiting as long as it takes
/// whatever `lock_timeout` the session inherited, which it restores after
/// the locks. For callers whose errors are not [`Error`]s (the migrator).
pub(crate) const LOCK_MANY_SQL: &str = include_str!("lock/sql/lock_many.sql");

fn sorted_unique(keys: impl IntoIterator<Item = LockKey>) -> Vec<i64> {
    let mut keys: Vec<i64> = keys.into_iter().map(LockKey::as_i64).collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derivation_is_stable() {
        // Pinned: changing the derivation would make old and new processes
        // take different locks for the same entity during a deploy.
        assert_eq!(
            LockKey::new("entity", "42").unwrap(),
            LockKey::new("entity", "42").unwrap()
        );
        assert_eq!(
            LockKey::new("entity", "42").unwrap().as_i64(),
            PINNED_ENTITY_42
        );
    }

    const PINNED_ENTITY_42: i64 = 1_914_804_616_194_582_404;

    #[test]
    fn namespace_and_key_do_not_run_into_each_other() {
        assert_ne!(
            LockKey::new("ab", "c").unwrap(),
            LockKey::new("a", "bc").unwrap()
        );
        assert_ne!(
            LockKey::new("entity", "1").unwrap(),
            LockKey::new("org", "1").unwrap()
        );
    }

    #[test]
    fn empty_or_nul_namespace_and_nul_key_are_rejected() {
        assert!(matches!(LockKey::new("", "x"), Err(Error::Invalid { .. })));
        assert!(matches!(
            LockKey::new("a\0b", "x"),
            Err(Error::Invalid { .. })
        ));
        assert!(matches!(
            LockKey::new("a", "x\0"),
            Err(Error::Invalid {
                what: "lock key",
                ..
            })
        ));
        assert!(LockKey::new("a", "").is_ok(), "an empty key is computable");
    }

    #[test]
    fn many_keys_are_sorted_and_deduplicated() {
        let k = |n| LockKey::from_raw(n);
        assert_eq!(sorted_unique([k(3), k(-1), k(3), k(2)]), vec![-1, 2, 3]);
    }
}
