//! The guard scenario (I1, at most one OPEN incident per entity): a worker
//! reads an entity's OPEN incidents, decides with no connection held, and
//! opens one only if it saw none. Everything that touches its rows is
//! here: the table, the read set, opening and resolving, the strategies'
//! writes with their typed outcome, and the history check. `pgonce race
//! guard` replays it step by step, `pgonce bench guard` measures it under
//! load, and `pgonce chaos --scenario guard` runs it under faults.
//!
//! A write is refused (`Written::Refused`) when another worker acted
//! first: the guard's re-read found another set, or a unique index turned
//! the insert away. That is the scenario working, not an error, so it is
//! an outcome callers count rather than an `Err` they must pick apart.

use std::time::Instant;

use pgonce::{Error, Guard, IsolationLevel, LockKey, ReadSet};
use sqlx::{PgConnection, PgPool};

/// One way to make the worker's read-evaluate-write safe (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardStrategy {
    /// The naive code: read in one transaction, write in another.
    TwoTransactions,
    /// Read, evaluate and write in one REPEATABLE READ transaction.
    RepeatableRead,
    /// Read, evaluate and write in one SERIALIZABLE transaction, retried.
    Serializable,
    /// A session-level advisory lock held across the evaluation.
    SessionLock,
    /// Two transactions behind a partial unique index.
    UniqueIndex,
    /// pgonce's guard: short read, evaluation with no connection held,
    /// then lock, re-read, compare and write.
    Guard,
    /// The guard with BEGIN and its lock in separate round trips
    /// (`Guard::begin`, then `GuardedTransaction::check`).
    GuardBeginCheck,
}

impl GuardStrategy {
    /// The strategy's name, as reports show it.
    pub fn name(self) -> &'static str {
        match self {
            GuardStrategy::TwoTransactions => "two-transactions",
            GuardStrategy::RepeatableRead => "repeatable-read",
            GuardStrategy::Serializable => "serializable",
            GuardStrategy::SessionLock => "session-lock",
            GuardStrategy::UniqueIndex => "unique-index",
            GuardStrategy::Guard => "guard",
            GuardStrategy::GuardBeginCheck => "guard-begin-check",
        }
    }

    /// Whether the strategy is expected to keep one open incident when two
    /// workers race on one entity.
    pub fn safe(self) -> bool {
        !matches!(
            self,
            GuardStrategy::TwoTransactions | GuardStrategy::RepeatableRead
        )
    }
}

/// Creates the scenario's table if it is missing (every driver calls it;
/// rows of different runs are kept apart by their scope).
pub(crate) async fn create_schema(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql(include_str!("sql/guard_schema.sql"))
        .execute(pool)
        .await
        .map(|_| ())
}

/// Empties the table, for a driver that owns its database and wants each
/// measurement to start from the same size.
pub(crate) async fn reset(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::query(include_str!("sql/guard_reset.sql"))
        .execute(pool)
        .await
        .map(|_| ())
}

/// The entity a worker decides about, within its run's scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entity {
    pub(crate) scope: String,
    pub(crate) name: String,
}

impl Entity {
    pub(crate) fn new(scope: impl Into<String>, name: impl Into<String>) -> Entity {
        Entity {
            scope: scope.into(),
            name: name.into(),
        }
    }

    /// The advisory key every locking strategy takes for this entity.
    pub(crate) fn lock_key(&self) -> pgonce::Result<LockKey> {
        LockKey::new(
            "guard-scenario/entity",
            &format!("{}/{}", self.scope, self.name),
        )
    }
}

/// What a worker does about what it saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Open an incident.
    Open,
    /// Resolve the OPEN incidents.
    Resolve,
}

impl Decision {
    /// The worker's rule: open one only if none is open (nothing to do
    /// otherwise).
    pub(crate) fn open_if_none(seen: &ReadSet) -> Option<Decision> {
        seen.is_empty().then_some(Decision::Open)
    }

    /// A loop that keeps writing: resolve what is open, or else open the
    /// next one.
    pub(crate) fn toggle(seen: &ReadSet) -> Decision {
        if seen.is_empty() {
            Decision::Open
        } else {
            Decision::Resolve
        }
    }
}

/// What a write did.
#[derive(Debug)]
pub(crate) enum Written {
    /// An incident was opened.
    Opened,
    /// The OPEN incidents were resolved.
    Resolved,
    /// Nothing was written: another worker acted since the read. The error
    /// says how (a guard's [`Error::Conflict`], a unique violation).
    Refused(Error),
}

/// A guarded write's outcome, and when its lock was granted (the start of
/// the lock hold).
#[derive(Debug)]
pub(crate) struct Guarded {
    pub(crate) written: Written,
    pub(crate) locked_at: Option<Instant>,
}

/// The entity's OPEN incidents, as a read set.
pub(crate) async fn read_open(conn: &mut PgConnection, entity: &Entity) -> pgonce::Result<ReadSet> {
    let ids: Vec<i64> = sqlx::query_scalar(include_str!("sql/guard_read_open.sql"))
        .bind(&entity.scope)
        .bind(&entity.name)
        .fetch_all(conn)
        .await?;
    Ok(ReadSet::from_ids(ids))
}

/// Opens an incident for the entity, tagged with `op`.
pub(crate) async fn open(conn: &mut PgConnection, entity: &Entity, op: i64) -> pgonce::Result<i64> {
    Ok(sqlx::query_scalar(include_str!("sql/guard_open.sql"))
        .bind(&entity.scope)
        .bind(&entity.name)
        .bind(op)
        .fetch_one(conn)
        .await?)
}

/// Resolves whatever is OPEN for the entity; returns how many.
pub(crate) async fn resolve(conn: &mut PgConnection, entity: &Entity) -> pgonce::Result<u64> {
    Ok(sqlx::query(include_str!("sql/guard_resolve.sql"))
        .bind(&entity.scope)
        .bind(&entity.name)
        .execute(conn)
        .await?
        .rows_affected())
}

/// Carries out `decision` on `conn`, in whatever transaction it is in.
pub(crate) async fn apply(
    conn: &mut PgConnection,
    entity: &Entity,
    decision: Decision,
    op: i64,
) -> pgonce::Result<Written> {
    Ok(match decision {
        Decision::Open => {
            open(conn, entity, op).await?;
            Written::Opened
        }
        Decision::Resolve => {
            resolve(conn, entity).await?;
            Written::Resolved
        }
    })
}

/// The read of the guarded strategies: one statement on a connection
/// released before the evaluation.
pub(crate) async fn read_guarded(
    guard: &Guard,
    pool: &PgPool,
    entity: &Entity,
) -> pgonce::Result<ReadSet> {
    guard.read(pool, async |c| read_open(c, entity).await).await
}

/// The unguarded write, in a transaction of its own, trusting the earlier
/// read. Behind a unique index an insert another worker beat is refused.
pub(crate) async fn write_plain(
    pool: &PgPool,
    entity: &Entity,
    decision: Decision,
    op: i64,
) -> pgonce::Result<Written> {
    let written = async {
        let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
        let written = apply(&mut tx, entity, decision, op).await?;
        tx.commit().await?;
        Ok(written)
    }
    .await;
    match written {
        Err(e) if is_unique_violation(&e) => Ok(Written::Refused(e)),
        other => other,
    }
}

fn is_unique_violation(e: &Error) -> bool {
    matches!(e, Error::Database(e)
        if pgonce::error::sqlstate_of(e).as_deref() == Some(pgonce::error::sqlstate::UNIQUE_VIOLATION))
}

/// pgonce's guarded write: lock the entity, re-read its OPEN incidents,
/// and carry out `decision` only if they are still `seen`; refused
/// otherwise.
pub(crate) async fn write_guarded(
    guard: &Guard,
    pool: &PgPool,
    entity: &Entity,
    seen: &ReadSet,
    decision: Decision,
    op: i64,
) -> pgonce::Result<Guarded> {
    let mut locked_at = None;
    let written = guard
        .write(
            pool,
            entity.lock_key()?,
            seen,
            async |c| {
                locked_at = Some(Instant::now());
                read_open(c, entity).await
            },
            async |c| apply(c, entity, decision, op).await,
        )
        .await;
    let written = match written {
        Ok(written) => written,
        Err(e @ Error::Conflict { .. }) => Written::Refused(e),
        Err(e) => return Err(e),
    };
    Ok(Guarded { written, locked_at })
}

/// Takes the entity's session-level lock on `conn`: held across
/// transactions until [`unlock_session`] or the session's end.
pub(crate) async fn lock_session(conn: &mut PgConnection, entity: &Entity) -> pgonce::Result<()> {
    sqlx::query(include_str!("sql/guard_session_lock.sql"))
        .bind(entity.lock_key()?.as_i64())
        .execute(conn)
        .await?;
    Ok(())
}

pub(crate) async fn unlock_session(conn: &mut PgConnection, entity: &Entity) -> pgonce::Result<()> {
    sqlx::query(include_str!("sql/guard_session_unlock.sql"))
        .bind(entity.lock_key()?.as_i64())
        .execute(conn)
        .await?;
    Ok(())
}

/// Two incidents of one entity that were OPEN at the same moment.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct Overlap {
    pub(crate) entity: String,
    pub(crate) first: i64,
    pub(crate) second: i64,
    pub(crate) first_op: i64,
    pub(crate) second_op: i64,
}

/// Every violation of I1 in `scope`'s history, not only in its end state.
pub(crate) async fn overlaps(pool: &PgPool, scope: &str) -> sqlx::Result<Vec<Overlap>> {
    sqlx::query_as(include_str!("sql/guard_overlaps.sql"))
        .bind(scope)
        .fetch_all(pool)
        .await
}
