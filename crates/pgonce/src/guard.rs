//! Guarded write (write-if-unchanged): act on a slow decision only if what
//! the decision saw has not changed since.
//!
//! A worker reads a set of rows ([`Guard::read`], a short read-only
//! transaction whose connection goes back to the pool before it returns),
//! evaluates for as long as it likes with **no connection checked out**, and
//! then calls [`Guard::write`]. The write opens its own short transaction,
//! takes a transaction-level advisory lock on the key, re-reads the set,
//! compares it with what the decision saw, and runs the caller's write only
//! if the two are equal; otherwise it rolls back and returns
//! [`Error::Conflict`] having written nothing. COMMIT or ROLLBACK releases
//! the lock; there is no path on which it outlives the transaction.
//!
//! Round trips of a guarded write: BEGIN and the lock in one simple-query
//! message ([`Guard::begin_for`]), the re-read, the write, COMMIT: one more
//! than the same write without a guard (BEGIN, write, COMMIT).
//!
//! # What it guarantees, and what it needs
//!
//! Every writer that changes the guarded set **must go through a guard with
//! the same lock key** (or take that key with [`crate::lock`] in its own
//! transaction; under SERIALIZABLE, reading the set before changing it:
//! see below). Then, for one key, the re-read, compare and write of
//! different callers never overlap, and a write happens only if the set is
//! the one the decision saw: two decisions made on the same state cannot
//! both write. The comparison is deliberately conservative: any change in the
//! set (an id appears, disappears or changes version) is a conflict, even
//! one that would not have changed the decision. The caller re-evaluates.
//!
//! # Why READ COMMITTED
//!
//! Under READ COMMITTED every *statement* takes a fresh snapshot when it
//! starts. The re-read runs after the lock statement returned, so its
//! snapshot is taken after the lock was granted and sees every write
//! committed by the previous holder of the lock. Under REPEATABLE READ the
//! snapshot is taken by the first statement of the transaction, which is the
//! lock statement itself: a re-read after a wait would see the state from
//! before the wait, miss the previous holder's insert, and let a duplicate
//! through. The guard therefore offers READ COMMITTED (the default) and
//! SERIALIZABLE, never REPEATABLE READ. A transaction from [`Guard::begin`]
//! whose caller changed its level before [`GuardedTransaction::check`]
//! (`SET TRANSACTION ISOLATION LEVEL`, still allowed before a transaction's
//! first statement) is refused by the check with [`Error::WrongIsolation`],
//! told by the lock statement itself, before any re-read.
//!
//! SERIALIZABLE takes its snapshot at the lock statement too, before the
//! wait, so there the re-read may be stale: it misses what the writers it
//! waited for committed. It is correct only because PostgreSQL aborts a
//! SERIALIZABLE transaction whose conflicts with others could close a
//! cycle: its stale re-read missed another's write (one conflict), and
//! that other read the set this one writes (the second). That detection
//! sees SERIALIZABLE transactions only, and only what they read. With
//! [`Isolation::Serializable`], every writer of the guarded set must
//! therefore run SERIALIZABLE as well, and read the set before changing
//! it, in the same transaction, as a guard's check does. A READ COMMITTED
//! writer holding the same key (a guard configured differently, or
//! [`crate::lock`] in a READ COMMITTED transaction) commits unseen; a
//! SERIALIZABLE one that changes the set without reading it (an insert
//! under [`crate::lock`]) conflicts one way only, and PostgreSQL orders the
//! waiting guarded write before it. Either way the stale re-read passes
//! and a duplicate goes through. Under READ COMMITTED, the default, the
//! lock alone suffices, whether the other writers read the set or not.
//!
//! # How long the lock is waited for
//!
//! [`GuardConfig::lock_timeout`] bounds the wait for the guard's lock, or,
//! `None`, leaves it unbounded; the `lock_timeout` the session inherited
//! (an operator's `ALTER ROLE ... SET lock_timeout`) does not apply to it.
//! `statement_timeout` still does, as it bounds every statement: it is the
//! operator's ceiling on any wait, the guard's included. A wait it ends
//! fails with [`Error::QueryCanceled`] (PostgreSQL's SQLSTATE 57014,
//! "canceling statement due to statement timeout"), not
//! [`Error::LockTimeout`]; nothing is written. Waited for in
//! [`Guard::begin_for`] (and so [`Guard::write`]), the connection goes back
//! to the pool outside any transaction; waited for in
//! [`GuardedTransaction::check`], the guarded transaction is aborted and
//! rolls back when dropped.
//!
//! # Cancel safety
//!
//! A caller may drop a guarded write at any await (its own timeout, a
//! `select!`, a client that hung up, a task aborted at shutdown), and
//! nothing is left behind. [`Guard::write`] and [`Guard::begin_for`] send
//! BEGIN and the lock from a task of their own, which rolls the
//! transaction back if nobody waits for it any more: dropped while the
//! lock is waited for, the wait goes on on the server, and once it ends the
//! transaction is rolled back and the lock released before the connection
//! goes back to the pool. Dropped later, the transaction is dropped with the
//! future and rolls back. Only a drop while the COMMIT is on its way may
//! leave the write committed, all of it. [`Guard::begin`] is cancel safe
//! as [`crate::begin`] is. [`GuardedTransaction::check`] dropped mid-way
//! leaves the transaction in an unknown state (its lock may yet be
//! granted): drop or roll back the [`GuardedTransaction`].
//!
//! # Example
//!
//! ```no_run
//! use pgonce::guard::{Guard, GuardConfig, ReadSet};
//! use pgonce::LockKey;
//! use sqlx::PgConnection;
//!
//! async fn open_ids(conn: &mut PgConnection, entity: i64) -> pgonce::Result<ReadSet> {
//!     let ids: Vec<i64> = sqlx::query_scalar(
//!         "SELECT id FROM incidents WHERE entity_id = $1 AND state = 'OPEN'",
//!     )
//!     .bind(entity)
//!     .fetch_all(conn)
//!     .await?;
//!     Ok(ReadSet::from_ids(ids))
//! }
//!
//! # async fn slow_evaluation(_: &ReadSet) -> bool { true }
//! # async fn f(pool: sqlx::PgPool) -> pgonce::Result<()> {
//! let guard = Guard::new("open-incident", GuardConfig::default())?;
//! let entity = 42;
//! // 1. A short read; the connection is back in the pool when this returns.
//! let seen = guard.read(&pool, async |c| open_ids(c, entity).await).await?;
//! // 2. Seconds of remote calls, no connection held.
//! if slow_evaluation(&seen).await {
//!     // 3. Lock, re-read, compare, insert, commit; or Error::Conflict.
//!     let key = LockKey::new("entity", &entity.to_string())?;
//!     match guard
//!         .write(&pool, key, &seen, async |c| open_ids(c, entity).await, async |c| {
//!             sqlx::query("INSERT INTO incidents (entity_id, state) VALUES ($1, 'OPEN')")
//!                 .bind(entity)
//!                 .execute(c)
//!                 .await?;
//!             Ok(())
//!         })
//!         .await
//!     {
//!         Ok(()) => {}
//!         Err(pgonce::Error::Conflict { .. }) => { /* someone else acted; re-evaluate later */ }
//!         Err(e) => return Err(e),
//!     }
//! }
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::error::{Error, Result, sqlstate, sqlstate_of};
use crate::lock::{self, LockKey};
use crate::transaction::IsolationLevel;

/// What a decision saw: a set of ids, each optionally with a version. Owned,
/// so it outlives the connection that read it.
///
/// Two read sets are equal when they hold the same ids with the same
/// versions; order and duplicates do not matter.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct ReadSet(BTreeMap<String, Option<i64>>);

impl ReadSet {
    /// The empty set ("nothing there").
    pub fn new() -> ReadSet {
        ReadSet::default()
    }

    /// A set of ids without versions.
    pub fn from_ids<I>(ids: I) -> ReadSet
    where
        I: IntoIterator,
        I::Item: ToString,
    {
        ReadSet(ids.into_iter().map(|id| (id.to_string(), None)).collect())
    }

    /// A set of `(id, version)` pairs: a changed version is a change.
    pub fn from_versions<I, K>(items: I) -> ReadSet
    where
        I: IntoIterator<Item = (K, i64)>,
        K: ToString,
    {
        ReadSet(
            items
                .into_iter()
                .map(|(id, v)| (id.to_string(), Some(v)))
                .collect(),
        )
    }

    /// Adds one id, with or without a version; returns `self` for chaining.
    pub fn with(mut self, id: impl ToString, version: Option<i64>) -> ReadSet {
        self.0.insert(id.to_string(), version);
        self
    }

    /// The number of distinct ids in the set.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the set holds no id (a decision that read nothing).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `id` is in the set.
    pub fn contains(&self, id: &str) -> bool {
        self.0.contains_key(id)
    }

    /// The ids, in ascending (string) order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }
}

impl fmt::Display for ReadSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (id, version)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match version {
                Some(v) => write!(f, "{id}@{v}")?,
                None => write!(f, "{id}")?,
            }
        }
        f.write_str("}")
    }
}

impl fmt::Debug for ReadSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ReadSet{self}")
    }
}

/// The isolation level of the guarded transaction. REPEATABLE READ is not
/// offered: its snapshot would predate the lock (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Isolation {
    /// Each statement sees what was committed before it started, so the
    /// re-read sees the previous lock holder's write. The default.
    #[default]
    ReadCommitted,
    /// Correct only if every writer of the guarded set runs SERIALIZABLE
    /// too and reads the set before changing it (see the module docs);
    /// PostgreSQL may abort with [`Error::SerializationFailure`], which the
    /// caller retries.
    Serializable,
}

/// Settings of a [`Guard`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardConfig {
    /// Isolation of the guarded write transaction. Default
    /// [`Isolation::ReadCommitted`].
    pub isolation: Isolation,
    /// Longest wait for the lock before [`Error::LockTimeout`]; `None` waits
    /// as long as it takes. Either way this bound, not the `lock_timeout`
    /// the session inherited (an operator's `ALTER ROLE ... SET
    /// lock_timeout`), applies to the guard's lock; the caller's own
    /// statements in the guarded transaction run with the session's.
    /// Default `None`. Must be at least 1 ms if set, and at most
    /// [`MAX_LOCK_TIMEOUT`](crate::lock::MAX_LOCK_TIMEOUT).
    pub lock_timeout: Option<Duration>,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            isolation: Isolation::ReadCommitted,
            lock_timeout: None,
        }
    }
}

/// A named write-if-unchanged operation (see the module docs). Cheap to
/// clone; the name labels its conflict counter and logs.
#[derive(Debug, Clone)]
pub struct Guard {
    name: String,
    config: GuardConfig,
}

impl Guard {
    /// A guard called `name` (non-empty, at most 200 bytes: it becomes a
    /// metric label).
    pub fn new(name: impl Into<String>, config: GuardConfig) -> Result<Guard> {
        let name = name.into();
        if name.is_empty() || name.len() > 200 {
            return Err(Error::Invalid {
                what: "guard name",
                why: "must be 1 to 200 bytes".into(),
            });
        }
        if let Some(timeout) = config.lock_timeout {
            crate::lock::check_lock_timeout(
                "guard lock_timeout",
                timeout,
                Duration::from_millis(1),
            )?;
        }
        Ok(Guard { name, config })
    }

    /// The name given to [`Guard::new`], used as the `guard` metric label.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The settings this guard was built with.
    pub fn config(&self) -> &GuardConfig {
        &self.config
    }

    /// The decision's read: runs `read` on a connection checked out for
    /// this call only and returns its owned result. The connection is back in
    /// the pool when this returns, so the evaluation that follows holds none.
    ///
    /// No transaction is opened: each statement is its own (READ COMMITTED,
    /// autocommit), which saves two round trips. Read the set in one
    /// statement if it must come from one snapshot; the guarded write's
    /// re-read under the lock is what the decision is checked against.
    pub async fn read<F>(&self, pool: &PgPool, read: F) -> Result<ReadSet>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<ReadSet>,
    {
        let mut conn = pool.acquire().await?;
        read(&mut conn).await
    }

    /// The guarded write: in one short transaction at the configured
    /// isolation level, takes the advisory lock `key`, runs `reread`, and if
    /// its result equals `seen` runs `write` and commits, returning `write`'s
    /// value. If the sets differ it rolls back, counts
    /// `pgonce_guard_conflicts_total{guard}`, logs at WARN and returns
    /// [`Error::Conflict`]: nothing is written. Any error from `reread` or
    /// `write` also rolls everything back.
    ///
    /// A connection is checked out from `pool` only for this transaction,
    /// opened by [`Guard::begin_for`] (BEGIN and lock in one round trip).
    /// Cancel safety: dropping the future drops the transaction, which rolls
    /// back and releases the lock (during the lock wait: see
    /// [`Guard::begin_for`]).
    pub async fn write<R, W, T>(
        &self,
        pool: &PgPool,
        key: LockKey,
        seen: &ReadSet,
        reread: R,
        write: W,
    ) -> Result<T>
    where
        R: AsyncFnOnce(&mut PgConnection) -> Result<ReadSet>,
        W: AsyncFnOnce(&mut PgConnection) -> Result<T>,
    {
        let mut tx = self.begin_for(pool, key).await?;
        let out = async {
            tx.check(key, seen, reread).await?;
            write(&mut tx.tx).await
        }
        .await;
        match out {
            Ok(out) => {
                tx.commit().await?;
                Ok(out)
            }
            Err(e) => {
                // Roll back now rather than when the connection is next
                // used, so the lock is free when this returns. A dead
                // connection cannot roll back; its lock died with it.
                let _ = tx.tx.rollback().await;
                Err(e)
            }
        }
    }

    /// Opens the guarded transaction at the configured isolation level, for
    /// callers whose write is more than one closure: several guards, a
    /// [`Sequence`](crate::Sequence) number taken last, other modules'
    /// writes that must commit with it. Call [`GuardedTransaction::check`],
    /// then write, then commit (or hand the transaction on with
    /// [`GuardedTransaction::into_inner`]).
    pub async fn begin<'p>(&self, pool: &'p PgPool) -> Result<GuardedTransaction<'p>> {
        Ok(GuardedTransaction {
            tx: crate::begin(pool, self.config.isolation.into()).await?,
            guard: self.clone(),
            locked: None,
        })
    }

    /// [`Guard::begin`] already holding the lock `key`: BEGIN and the lock
    /// travel in one round trip instead of two (see
    /// `guard/sql/begin_locked.sql`). [`GuardedTransaction::check`] with the
    /// same key then only re-reads and compares. [`Guard::write`] uses it.
    ///
    /// Waits for the lock as [`GuardedTransaction::check`] would: as long as
    /// it takes, or [`Error::LockTimeout`] after the configured
    /// `lock_timeout` (the connection is then back in the pool outside any
    /// transaction).
    ///
    /// Cancel safety: if this future is dropped while it waits, it hands
    /// the BEGIN-and-lock round trip to a task of its own, which still
    /// waits for the lock, then rolls back and returns the connection to
    /// the pool, so no connection ever goes back to the pool inside a
    /// transaction.
    /// (A dropped wait in [`GuardedTransaction::check`] behaves the same way:
    /// the connection is returned once the lock statement has finished.)
    pub async fn begin_for<'p>(
        &self,
        pool: &'p PgPool,
        key: LockKey,
    ) -> Result<GuardedTransaction<'p>> {
        let isolation = IsolationLevel::from(self.config.isolation).as_sql();
        let sql = BEGIN_LOCKED
            .replace("{isolation}", isolation)
            .replace("{key}", &key.as_i64().to_string())
            .replace(
                "{millis}",
                &self
                    .config
                    .lock_timeout
                    .map_or(0, crate::lock::lock_timeout_millis)
                    .to_string(),
            );
        let tx = match crate::transaction::begin_cancel_safe(pool, sql).await {
            Ok(tx) => tx,
            Err(e) if sqlstate_of(&e).as_deref() == Some(sqlstate::LOCK_NOT_AVAILABLE) => {
                return Err(Error::LockTimeout {
                    key,
                    waited: self.config.lock_timeout.unwrap_or_default(),
                });
            }
            Err(e) => return Err(e.into()),
        };
        Ok(GuardedTransaction {
            tx,
            guard: self.clone(),
            locked: Some(key),
        })
    }
}

/// `guard/sql/begin_locked.sql` without its comment lines: the text sent on
/// every guarded write.
static BEGIN_LOCKED: LazyLock<String> =
    LazyLock::new(|| crate::lock::without_comments(include_str!("guard/sql/begin_locked.sql")));

/// A transaction opened by [`Guard::begin`], so at an isolation level under
/// which the guard's re-read is correct (the type opens no REPEATABLE READ
/// transaction, and [`GuardedTransaction::check`] refuses one its caller
/// switched to with [`Error::WrongIsolation`]). Dereferences to the
/// [`Transaction`] for the caller's writes. Dropping it rolls back, but
/// only when the connection is next used: see [`GuardedTransaction::rollback`].
#[derive(Debug)]
pub struct GuardedTransaction<'p> {
    tx: Transaction<'p, Postgres>,
    guard: Guard,
    /// The key taken with BEGIN by [`Guard::begin_for`], if any.
    locked: Option<LockKey>,
}

impl<'p> GuardedTransaction<'p> {
    /// Takes the advisory lock `key` (held until this transaction ends;
    /// already held if [`Guard::begin_for`] opened the transaction with this
    /// key), runs `reread`, and compares its result with `seen`. Different:
    /// counts `pgonce_guard_conflicts_total{guard}`, logs at WARN and
    /// returns [`Error::Conflict`]; the caller must not write (roll back, or
    /// drop the transaction). Equal: the caller may write in this
    /// transaction, and no other guarded writer of `key` can change the set
    /// before it ends.
    ///
    /// Checking several keys in one transaction can deadlock unless every
    /// caller checks them in the same order; PostgreSQL then aborts one with
    /// [`Error::SerializationFailure`] (retryable).
    ///
    /// [`Error::WrongIsolation`] when the transaction no longer runs at the
    /// guard's level (its caller ran `SET TRANSACTION ISOLATION LEVEL`
    /// before this check): the re-read is not run, and the caller must not
    /// write; rolling back releases the lock. Told in the lock's own round
    /// trip.
    pub async fn check<R>(&mut self, key: LockKey, seen: &ReadSet, reread: R) -> Result<()>
    where
        R: AsyncFnOnce(&mut PgConnection) -> Result<ReadSet>,
    {
        let guard = &self.guard;
        if self.locked != Some(key) {
            let isolation = match guard.config.lock_timeout {
                Some(t) => lock::lock_timeout_reporting_isolation(&mut self.tx, key, t).await?,
                None => lock::lock_reporting_isolation(&mut self.tx, key).await?,
            };
            // The transaction was begun at the configured level, but its
            // caller could change it before this, its first statement
            // (`SET TRANSACTION ISOLATION LEVEL`). Under REPEATABLE READ
            // the lock statement took the snapshot before its wait, and
            // the re-read would miss the previous holder's write.
            let needed = IsolationLevel::from(guard.config.isolation).as_sql();
            if !needed.eq_ignore_ascii_case(&isolation) {
                return Err(Error::WrongIsolation {
                    strategy: "guard",
                    needed,
                    found: isolation,
                });
            }
        }
        // READ COMMITTED: this statement's snapshot is taken now, after the
        // lock was granted.
        let found = reread(&mut self.tx).await?;
        if &found == seen {
            return Ok(());
        }
        metrics::counter!("pgonce_guard_conflicts_total", "guard" => guard.name.clone())
            .increment(1);
        tracing::warn!(
            guard = %guard.name,
            %key,
            expected = %seen,
            %found,
            "guarded write refused: the read set changed since the decision"
        );
        Err(Error::Conflict {
            guard: guard.name.clone(),
            expected: seen.clone(),
            found,
        })
    }

    /// Rolls back now, releasing the lock before this returns. Prefer it to
    /// dropping the transaction: sqlx sends a dropped transaction's ROLLBACK
    /// only when the connection is next used, and until then the lock stays
    /// held.
    pub async fn rollback(self) -> Result<()> {
        Ok(self.tx.rollback().await?)
    }

    /// Commits the transaction (and releases the lock).
    pub async fn commit(self) -> Result<()> {
        Ok(self.tx.commit().await?)
    }

    /// The transaction itself, to be committed by the caller (for instance
    /// by [`Sequence::commit_numbered`](crate::Sequence::commit_numbered)).
    pub fn into_inner(self) -> Transaction<'p, Postgres> {
        self.tx
    }
}

impl<'p> std::ops::Deref for GuardedTransaction<'p> {
    type Target = Transaction<'p, Postgres>;
    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl std::ops::DerefMut for GuardedTransaction<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.tx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_sets_compare_as_sets_with_versions() {
        assert_eq!(ReadSet::from_ids([3, 1, 1]), ReadSet::from_ids([1, 3]));
        assert_ne!(ReadSet::from_ids([1]), ReadSet::from_ids([1, 2]));
        assert_ne!(
            ReadSet::from_versions([(1, 4)]),
            ReadSet::from_versions([(1, 5)])
        );
        assert_ne!(ReadSet::from_ids([1]), ReadSet::from_versions([(1, 5)]));
        assert_eq!(ReadSet::new(), ReadSet::from_ids(Vec::<i64>::new()));
        assert_eq!(
            ReadSet::from_versions([("a", 1)])
                .with("b", None)
                .to_string(),
            "{a@1, b}"
        );
    }

    #[test]
    fn bad_config_is_rejected() {
        assert!(matches!(
            Guard::new("", GuardConfig::default()),
            Err(Error::Invalid { .. })
        ));
        let config = GuardConfig {
            lock_timeout: Some(Duration::ZERO),
            ..GuardConfig::default()
        };
        assert!(matches!(
            Guard::new("g", config),
            Err(Error::Invalid { .. })
        ));
    }
}
