//! Beginning a transaction at a stated isolation level: the one way the
//! library, its service, its lab and its tests open a transaction.
//!
//! Every pattern in pgonce is correct only at a given isolation level (the
//! guard and the max + 1 sequences need READ COMMITTED's per-statement
//! snapshot, the `Serializable` append strategy needs SERIALIZABLE), and a
//! database's `default_transaction_isolation` is whatever its operator set.
//! So nothing inherits it: [`begin`] sends the level with the BEGIN, in the
//! same round trip, and the transaction runs at that level from its first
//! statement.
//!
//! Statements that combine BEGIN with a lock in one round trip (the guard's
//! and the event store's `begin_locked` SQL) state their level in that
//! statement instead; they are one round trip on purpose.
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> sqlx::Result<()> {
//! use pgonce::IsolationLevel;
//!
//! let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted).await?;
//! sqlx::query("SELECT 1").execute(&mut *tx).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};

use futures::future::BoxFuture;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres, Row, Transaction};

/// A transaction isolation level of PostgreSQL, as a BEGIN states it.
/// READ UNCOMMITTED is left out: PostgreSQL runs it as READ COMMITTED.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IsolationLevel {
    /// Each statement sees what was committed before it started: a re-read
    /// after a lock was granted sees the previous holder's writes.
    ReadCommitted,
    /// One snapshot for the whole transaction, taken at its first
    /// statement; a write to a row changed since is a serialization
    /// failure (SQLSTATE 40001).
    RepeatableRead,
    /// REPEATABLE READ plus the detection of dangerous read/write cycles
    /// among SERIALIZABLE transactions, each aborted with SQLSTATE 40001.
    Serializable,
}

impl IsolationLevel {
    /// Every level, weakest first.
    pub const ALL: [IsolationLevel; 3] = [
        IsolationLevel::ReadCommitted,
        IsolationLevel::RepeatableRead,
        IsolationLevel::Serializable,
    ];

    /// The level as SQL spells it (`READ COMMITTED`), and as
    /// `current_setting('transaction_isolation')` reports it in upper case.
    pub const fn as_sql(self) -> &'static str {
        match self {
            IsolationLevel::ReadCommitted => "READ COMMITTED",
            IsolationLevel::RepeatableRead => "REPEATABLE READ",
            IsolationLevel::Serializable => "SERIALIZABLE",
        }
    }

    /// The BEGIN statement that opens a read-write transaction at this level.
    pub(crate) const fn begin(self) -> &'static str {
        match self {
            IsolationLevel::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            IsolationLevel::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            IsolationLevel::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }

    /// The BEGIN statement that opens a read-only transaction at this level.
    const fn begin_read_only(self) -> &'static str {
        match self {
            IsolationLevel::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY",
            IsolationLevel::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
            IsolationLevel::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY",
        }
    }
}

impl fmt::Display for IsolationLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_sql())
    }
}

impl From<crate::guard::Isolation> for IsolationLevel {
    fn from(isolation: crate::guard::Isolation) -> IsolationLevel {
        match isolation {
            crate::guard::Isolation::ReadCommitted => IsolationLevel::ReadCommitted,
            crate::guard::Isolation::Serializable => IsolationLevel::Serializable,
        }
    }
}

/// Begins a read-write transaction on a connection of `pool` at `level`,
/// stated in the BEGIN itself, so no statement of the transaction runs at
/// the database's default level. Dropped without a commit, the transaction
/// rolls back before its connection is reused (sqlx's [`Transaction`]).
///
/// Cancel safe: a caller dropped while the BEGIN is on its way leaves no
/// transaction open on the pooled connection. The drop hands the BEGIN's
/// round trip to a task of its own, which drops (rolls back) the
/// transaction once it is begun.
///
/// Errors are sqlx's: only the pool (no connection) or the server (BEGIN
/// refused) can fail here.
pub async fn begin(
    pool: &PgPool,
    level: IsolationLevel,
) -> sqlx::Result<Transaction<'static, Postgres>> {
    begin_cancel_safe(pool, level.begin().to_owned()).await
}

/// [`begin`], read-only: PostgreSQL refuses every write in it (SQLSTATE
/// 25006), so a reader that must not write cannot by mistake.
pub async fn begin_read_only(
    pool: &PgPool,
    level: IsolationLevel,
) -> sqlx::Result<Transaction<'static, Postgres>> {
    begin_cancel_safe(pool, level.begin_read_only().to_owned()).await
}

/// Runs `work` in a READ COMMITTED transaction of its own on a connection
/// of `pool` ([`begin`]) and commits it. For the library's own passes (the
/// reaper, the re-driver, the cleaners), whose `FOR UPDATE SKIP LOCKED`
/// then re-check is correct at READ COMMITTED: run alone on the pool,
/// their statements would be transactions at the database's default level,
/// and under a stricter one a row changed by a writer that committed after
/// the statement's snapshot would be a serialization failure (40001)
/// instead of a row skipped or re-checked.
///
/// On an error the transaction is rolled back before the error is
/// returned, not left to its drop: sqlx then only queues the ROLLBACK,
/// sent when the pool tests the connection in a task of its own, and until
/// then the rows `work` locked stay locked. A loop's next pass, run at once
/// on another connection, would skip them and find nothing to do: a pass
/// that succeeds in the middle of a run of failures.
pub(crate) async fn read_committed<T, E: From<sqlx::Error>>(
    pool: &PgPool,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
) -> Result<T, E> {
    let mut tx = begin(pool, IsolationLevel::ReadCommitted).await?;
    match work(&mut tx).await {
        Ok(out) => {
            tx.commit().await?;
            Ok(out)
        }
        Err(e) => {
            // Its own failure is not the caller's: the error is `work`'s,
            // and a connection that cannot roll back is closed by the pool.
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

/// Runs `work` on `conn`: in the transaction open on it if there is one
/// (its level is the caller's), otherwise in a READ COMMITTED transaction
/// of its own, committed once `work` succeeds and rolled back when it
/// fails. For the library's functions that take a bare connection, whose
/// statements would otherwise each be a transaction at the database's
/// default level (see [`read_committed`]).
///
/// A transaction counts whether sqlx began it or the caller ran `BEGIN`
/// as a statement, which sqlx does not track: a BEGIN and COMMIT of our
/// own inside the caller's transaction would commit it half way (the
/// BEGIN only warns), or be refused once it has a REPEATABLE READ or
/// SERIALIZABLE snapshot (SQLSTATE 25001), aborting it. Telling the two
/// apart costs a round trip, on a connection sqlx shows outside a
/// transaction only ([`in_transaction_block`]).
///
/// Not cancel safe as [`begin`] is: the BEGIN runs on `conn` itself (a
/// borrowed connection cannot be handed to a task), so a future dropped
/// after the BEGIN was sent and before its answer was read leaves `conn`
/// inside a transaction sqlx does not know of, as sqlx's own
/// `Connection::begin` does. Callers that own a pool use [`read_committed`].
pub(crate) async fn read_committed_unless_in_transaction<T, E: From<sqlx::Error>>(
    conn: &mut PgConnection,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
) -> Result<T, E> {
    if conn.is_in_transaction() || in_transaction_block(conn).await? {
        return work(conn).await;
    }
    let mut tx = conn
        .begin_with(IsolationLevel::ReadCommitted.begin())
        .await?;
    let out = work(&mut tx).await?;
    tx.commit().await?;
    Ok(out)
}

/// Whether the server has a transaction block open on `conn`, begun by a
/// `BEGIN` sqlx did not send. Hand-written: sqlx reads the server's
/// transaction status from every ReadyForQuery message but keeps it to
/// itself (`PgConnection::in_transaction` is crate-private in sqlx 0.9),
/// and its `is_in_transaction` counts only the transactions it began.
///
/// PostgreSQL's `statement_timestamp()` is when the latest command message
/// arrived and `transaction_timestamp()` when the transaction started;
/// "they return the same value during the first command of a transaction"
/// (the date/time functions' documentation). Sent as a simple query (one
/// message: `raw_sql`, not a prepared statement, whose Bind and Execute
/// are messages of their own), the probe is the first command of its
/// transaction outside a block, and a later one inside it, whose start
/// (its BEGIN's arrival) lies at least a round trip before.
async fn in_transaction_block(conn: &mut PgConnection) -> sqlx::Result<bool> {
    let row = sqlx::raw_sql("SELECT statement_timestamp() <> transaction_timestamp()")
        .fetch_one(&mut *conn)
        .await?;
    row.try_get(0)
}

/// Runs `sql`, a BEGIN statement (possibly followed by statements that take
/// locks, in one simple-query round trip), on a connection of `pool` and
/// returns the open transaction. Every transaction the crate opens on a
/// pool begins here: [`begin`], and the guard's and the event store's
/// `begin_locked` statements.
///
/// Cancel safety: sqlx counts a transaction as open only once its BEGIN
/// statement has returned: a future dropped after the BEGIN was sent and
/// before its answer was read (however short that window, and for as long
/// as a lock in the same statement is waited for) would let the connection
/// go back to the pool inside the transaction, locks held, with sqlx
/// believing it idle. Every later statement on it would then join that
/// transaction and never commit, while its caller saw success. So a caller
/// that stops waiting hands the round trip to a task
/// ([`FinishedOrHandedOff`]), which reads its answer and drops the
/// transaction, rolling it back before the connection is reused.
pub(crate) async fn begin_cancel_safe(
    pool: &PgPool,
    sql: String,
) -> sqlx::Result<Transaction<'static, Postgres>> {
    let pool = pool.clone();
    FinishedOrHandedOff::new(
        Box::pin(async move { pool.begin_with(sqlx::AssertSqlSafe(sql)).await }),
        None,
        // Dropped unanswered: rolled back.
        Box::new(|begun| Box::pin(async move { drop(begun) })),
    )
    .await
}

/// Runs `work` on one connection of `pool` and returns what it returns;
/// not at all if the caller stopped waiting before a connection was free.
/// If the caller stops waiting later (its future dropped, which may happen
/// after `work`'s statements were sent and the server runs them anyway),
/// `give_back` undoes what `work` took for it, on the same connection,
/// before that connection serves anyone else. For calls that take
/// something the caller alone can let go of (an idempotency key's hold, a
/// job's lease, a queue's deliveries), which a dropped caller would leave
/// taken, by nobody, until it runs out.
///
/// Hand-written: nothing in sqlx or tokio runs a clean-up on the output of
/// a future whose caller is gone.
pub(crate) async fn answered_or_given_back<T, G>(
    pool: &PgPool,
    work: impl for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, crate::Result<T>> + Send + 'static,
    give_back: G,
) -> crate::Result<T>
where
    T: Send + 'static,
    G: for<'c> FnOnce(&'c mut PgConnection, T) -> BoxFuture<'c, ()> + Send + 'static,
{
    let pool = pool.clone();
    let working = Arc::new(AtomicBool::new(false));
    let run = {
        let working = Arc::clone(&working);
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            working.store(true, Ordering::Release);
            let taken = work(&mut conn).await?;
            Ok(Answered { taken, conn })
        })
    };
    let answered = FinishedOrHandedOff::new(
        run,
        Some(working),
        Box::new(|answer: crate::Result<Answered<T>>| {
            Box::pin(async move {
                if let Ok(Answered { taken, mut conn }) = answer {
                    give_back(&mut conn, taken).await;
                }
            })
        }),
    )
    .await?;
    // The connection goes back to the pool here, its work done.
    Ok(answered.taken)
}

/// What [`answered_or_given_back`]'s work took, and the connection it
/// took it on, still held, so that a give-back runs on it before anyone
/// else's statement does.
struct Answered<T> {
    taken: T,
    conn: PoolConnection<Postgres>,
}

/// A call's future, polled by its caller in the caller's own task, which
/// a dropped caller hands over to a task of its own: that task polls it to
/// its answer and passes the answer to `abandoned` (which gives back what
/// the call took, or rolls back what it began).
///
/// Polled inline because a task per call would cost two scheduling hops
/// (the spawn, and the wake by the task's answer), which on a busy runtime
/// outweigh the statements themselves: a queue receive's median latency
/// was three times as long in `pgonce bench queue`. Only a dropped call
/// pays for a task.
struct FinishedOrHandedOff<T: Send + 'static> {
    /// The call; `None` once it answered.
    run: Option<BoxFuture<'static, T>>,
    /// When given, set once the call took something (it holds a connection
    /// and its work began): dropped before, nothing was taken, and the
    /// call is simply abandoned where it is (an acquire from the pool).
    started: Option<Arc<AtomicBool>>,
    /// True while `run` is being polled: still true in `drop` only when
    /// that poll panicked, and a panicked future is never polled again.
    polling: bool,
    abandoned: Option<Abandoned<T>>,
    /// The caller's span, so that what a handed-off call logs says whose
    /// call it was.
    span: tracing::Span,
}

/// What a handed-off call's answer is given to.
type Abandoned<T> = Box<dyn FnOnce(T) -> BoxFuture<'static, ()> + Send>;

impl<T: Send + 'static> FinishedOrHandedOff<T> {
    fn new(
        run: BoxFuture<'static, T>,
        started: Option<Arc<AtomicBool>>,
        abandoned: Abandoned<T>,
    ) -> Self {
        FinishedOrHandedOff {
            run: Some(run),
            started,
            polling: false,
            abandoned: Some(abandoned),
            span: tracing::Span::current(),
        }
    }
}

// Nothing is pinned in place: `run` is boxed.
impl<T: Send + 'static> Unpin for FinishedOrHandedOff<T> {}

impl<T: Send + 'static> Future for FinishedOrHandedOff<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = &mut *self;
        let run = this.run.as_mut().expect("polled after it answered");
        this.polling = true;
        let answer = run.as_mut().poll(cx);
        this.polling = false;
        let answer = ready!(answer);
        this.run = None;
        Poll::Ready(answer)
    }
}

impl<T: Send + 'static> Drop for FinishedOrHandedOff<T> {
    fn drop(&mut self) {
        let (Some(run), Some(abandoned)) = (self.run.take(), self.abandoned.take()) else {
            return;
        };
        let started = self
            .started
            .as_ref()
            .is_none_or(|started| started.load(Ordering::Acquire));
        // Interrupted mid-poll by a panic, or dropped before it took
        // anything: nothing to finish.
        if self.polling || !started {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Dropped outside a runtime, which only a runtime shutting
            // down does: the connection is dropped mid-call and closed, so
            // what it took stays taken until it runs out.
            tracing::warn!("a call dropped outside a runtime could not give back what it took");
            return;
        };
        let finish = async move { abandoned(run.await).await };
        runtime.spawn(tracing::Instrument::instrument(finish, self.span.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::IsolationLevel;

    #[test]
    fn each_begin_states_its_level() {
        for level in IsolationLevel::ALL {
            assert_eq!(
                level.begin(),
                format!("BEGIN ISOLATION LEVEL {}", level.as_sql())
            );
            assert_eq!(
                level.begin_read_only(),
                format!("BEGIN ISOLATION LEVEL {} READ ONLY", level.as_sql())
            );
        }
    }
}
