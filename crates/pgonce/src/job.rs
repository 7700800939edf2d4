//! Jobs whose row is their own state machine (pattern P3, against an SQS
//! worker's duplicate execution).
//!
//! A queue delivers a job's message at least once; the `pgonce.jobs` row
//! decides what a delivery may do. Three guards, weakest first:
//!
//! * [`transition`]: the conditional update `UPDATE ... WHERE id = $1 AND
//!   status = $expected`. Two deliveries racing on one job both run their
//!   side effect, but only one transition applies; the other gets
//!   [`Error::AlreadyHandled`]. Enough when the side effect may run twice.
//! * two-phase: [`claim`] (pending to processing, returning a [`Lease`])
//!   before the side effect, then [`complete`] or [`fail`] fenced by the lease.
//!   The side effect runs once per successful claim. A losing delivery gets
//!   [`Error::AlreadyHandled`] only when the job is terminal; while it is
//!   not, [`Error::JobBusy`], and keeps its message, so a job whose claimer
//!   crashes still has a message to drive it once reaped. A slow worker keeps its
//!   lease with [`heartbeat`]; a crashed worker's lease expires and the
//!   [`Reaper`] makes the job runnable again (or a delivery of its message
//!   takes the expired lease over first), so it is not lost. A worker whose
//!   lease was reaped or taken over gets [`Error::LeaseLost`] and cannot
//!   overwrite the new owner's outcome. It keeps its message: reaped and
//!   not yet taken over, the job is pending with nobody holding it, and
//!   that message's next delivery claims it (or hears that another
//!   delivery holds it, or that it is done).
//! * for effects that are not transitions (a counter), [`crate::dedupe`].
//!
//! ```no_run
//! # async fn worker(pool: sqlx::PgPool, id: i64) -> pgonce::Result<()> {
//! use std::time::Duration;
//! use pgonce::{Error, job};
//! let lease = match job::claim(&pool, id, Duration::from_secs(60)).await {
//!     Ok(lease) => lease,
//!     // Done (completed or dead): acknowledge, do nothing.
//!     Err(Error::AlreadyHandled { .. }) => return Ok(()),
//!     // In another delivery's hands (or waiting for its retry): do not
//!     // acknowledge. The message comes back; if that delivery crashed, its
//!     // lease has run out by then and this message claims the job.
//!     Err(e @ Error::JobBusy { .. }) => return Err(e),
//!     Err(e) => return Err(e),
//! };
//! // ... the side effect, heartbeating if it may outlast the lease ...
//! // Err(LeaseLost): our lease ran out and the job was reaped or taken
//! // over. Do not acknowledge: the message's next delivery claims the job
//! // if it is pending with nobody holding it.
//! job::complete(&pool, &lease, &serde_json::json!({"ok": true})).await
//! # }
//! ```
//!
//! # States
//!
//! | state | leaves by | who moves it |
//! |---|---|---|
//! | `pending` | [`claim`] / [`claim_batch`] to `processing`; [`transition`] to `completed` or `dead` | workers |
//! | `processing` | [`complete`] to `completed`; [`fail`] to `failed` or `dead`; lease expiry to `pending` or `dead`, or [`claim`] taking the expired lease over (or, on the last attempt, making the job `dead`) | the lease holder; the [`Reaper`] or a delivery of its message once the lease expired |
//! | `failed` | due (`run_at` passed): [`claim`] to `processing`, or to `pending` | a delivery of its message; the [`Redriver`] |
//! | `completed` | terminal | |
//! | `dead` | terminal for workers (`last_error` says why); an operator's [`retry_dead`] / [`retry_dead_jobs`] to `pending`, audited | an operator |
//!
//! `attempts` counts failed attempts (errors and expired leases) and is only
//! ever incremented in SQL (`attempts = attempts + 1`), never read, changed
//! and written back. A job reaching `max_attempts` goes to `dead`.
//!
//! # Isolation
//!
//! Every function runs one statement on the executor it is given: a pool (the
//! statement is its own transaction, at the database's default isolation
//! level: READ COMMITTED unless an operator set another with `ALTER
//! DATABASE ... SET default_transaction_isolation`, and then the rules
//! below for that level apply) or the caller's transaction, so the job's
//! transition commits with the caller's writes. The exceptions are the
//! passes that skip locked rows and re-check them, correct at READ
//! COMMITTED: [`claim_batch`] on a pool or a bare connection, the
//! [`Reaper`], the [`Redriver`] and an operator's [`retry_dead`] or
//! [`retry_dead_jobs`] on a bare connection (outside any transaction,
//! whether begun through sqlx or by a `BEGIN` run as a statement) each run
//! in a READ COMMITTED transaction of their own, whatever the database's
//! default.
//! Under READ COMMITTED a delivery that lost a race re-reads the row after the
//! winner commits, matches nothing and gets [`Error::AlreadyHandled`] (or
//! [`Error::JobBusy`] from [`claim`], or [`Error::LeaseLost`]). Under REPEATABLE READ or SERIALIZABLE PostgreSQL
//! raises SQLSTATE 40001 instead, mapped to [`Error::SerializationFailure`]:
//! roll back and run the whole transaction again; its fresh snapshot sees the
//! winner's state and the retry gets `JobBusy` while the winner holds the
//! job, `AlreadyHandled` once it is done (see [`Error::is_retryable`] and the
//! test `repeatable_read_loser_gets_40001_then_job_busy_on_retry`).
//!
//! The lease's own writes ([`complete`], [`complete_many`], [`fail`],
//! [`heartbeat`]) may run in a transaction other than the claim's. Under
//! REPEATABLE READ or SERIALIZABLE, one whose snapshot predates the claim
//! (the work's transaction begun and read from before the job was claimed
//! on the pool) sees the job still pending, so its write matches nothing.
//! That is [`Error::SerializationFailure`], not [`Error::LeaseLost`]: the
//! lease is still the worker's, and the transaction's retry sees it
//! (migration 0200). Acknowledging the message on a false `LeaseLost`
//! would leave the job, once reaped, with no message to drive it. Only a
//! lease that is really lost gives [`Error::LeaseLost`], at every
//! isolation level. The same holds at READ COMMITTED for a lease used on
//! another connection before the transaction that claimed it committed:
//! that claim may still commit or roll back. A heartbeat run on another connection than the work's
//! REPEATABLE READ transaction changes the row after that transaction's
//! snapshot: completing in it is then a serialization failure too, so
//! heartbeat in the work's transaction (which also keeps the reaper off
//! the row until it ends) or run the work at READ COMMITTED.
//!
//! # Waits
//!
//! A statement that meets a job row another transaction is changing (a
//! transition, a claim or a lease's write in a transaction not yet ended,
//! an operator's retry) waits for that transaction, as the races above
//! describe, within the `lock_timeout` the session inherited if there is
//! one (an operator's `ALTER ROLE ... SET lock_timeout`): past it the call
//! fails with [`Error::LockNotAvailable`], nothing written. A worker keeps
//! its message then, as for [`Error::JobBusy`]. `statement_timeout` bounds
//! every statement: past it [`Error::QueryCanceled`], nothing written, and
//! the message is kept too.
//! [`claim_batch`], the [`Reaper`] and the [`Redriver`] never wait for a
//! row: they skip locked ones.
//!
//! # Cancel safety
//!
//! A caller may drop any of these futures at any await (its own timeout,
//! a `select!`, a task aborted at shutdown). A statement once sent runs on
//! the server whether or not anyone reads its answer; on a pool, its
//! connection goes back to the pool only once it has, outside any
//! transaction and holding no lock. Each call is one statement, or one
//! transaction of its own, so what it writes is all there or absent, never
//! half; but a dropped caller does not learn which:
//!
//! * [`claim`] on a pool: nothing. It runs on one pooled connection (not
//!   at all if its caller is gone by the time a connection is free);
//!   dropped once its statement was sent (while it waits for a transaction
//!   holding the job's row, say), the server still claims the job, so the
//!   drop hands the claim to a task of its own, which finishes it and gives
//!   that lease back (the job pending
//!   again, runnable at once, no attempt counted) before the connection
//!   serves anyone else. Only when that fails too (the connection or the
//!   server died, the runtime shut down) is the job left `processing` under
//!   a lease nobody has: its message hears [`Error::JobBusy`] until the
//!   lease runs out, and the [`Reaper`], or a delivery taking the lease
//!   over, counts it as a failed attempt, as for a worker that died.
//! * [`claim_batch`] on a pool: nothing, the same way. A drop hands its
//!   transaction to a task of its own, which commits it and gives every
//!   lease of the batch back. On a bare connection, see [`ClaimBatchOn`].
//! * [`complete`], [`complete_many`], [`fail`], [`transition`]: written or
//!   not. Written, the job moved on, and the same call again gets
//!   [`Error::LeaseLost`] ([`Error::AlreadyHandled`] from [`transition`]):
//!   keep the message then, as the consumer policy says; its next delivery
//!   hears [`Error::AlreadyHandled`], or, after a [`fail`], claims the job
//!   once its retry is due.
//! * [`heartbeat`]: extended or not; run it again.
//! * [`enqueue`] on a pool: the job may exist without its id reaching the
//!   caller. Enqueue in the transaction that writes what the job is for,
//!   so both commit or neither.
//!
//! In a transaction of the caller's, a dropped call's statement may have
//! run, or may yet run before the transaction's next statement: roll the
//! transaction back, as after an error, rather than commit it.
//!
//! # The consumer policy
//!
//! See [`crate::queue::AckPolicy`]: with `AlwaysDelete` the queue message is deleted
//! whatever the outcome, the row is the retry ledger (the [`Redriver`]
//! makes a failed job pending once due, and [`Redriver::run_handing_on`]
//! publishes a message per job), and the queue's
//! dead-letter queue only catches infrastructure failures. Except when
//! nothing was recorded: a [`Error::JobBusy`] (the job is in another
//! delivery's hands), a panic, a retryable error (PostgreSQL rolled
//! the attempt's transaction back), an [`Error::LockNotAvailable`] (a
//! wait for the job's row given up, see Waits), an
//! [`Error::QueryCanceled`] (a statement cut by `statement_timeout`), an
//! [`Error::Database`] that says the connection was lost or an
//! [`Error::Pooler`] (PgBouncer finding no server while PostgreSQL
//! restarts, say) keeps the message: as if the process had died, a job it
//! had claimed is left to its lease's end, and then to this message.
//!
//! A handler that recorded its attempt's failure with [`fail`] returns it
//! as a [`FailureRecorded`], whatever failed the work (a serialization
//! failure in the work's transaction included): the worker deletes the
//! message, and the row drives the retry. The message yields, not the
//! re-driver: under this policy the re-driver drives every failed job, and
//! the row cannot tell one whose message was kept. Each attempt is then
//! one delivery. Should the process die:
//!
//! * before `fail` commits: nothing is recorded, the message (not deleted)
//!   comes back after its visibility timeout, finds the job processing
//!   ([`Error::JobBusy`] until the lease ends), and claims it once the
//!   lease has run out;
//! * after `fail` commits, before the delete: the message comes back too,
//!   finds the job failed ([`Error::JobBusy`] until its retry is due), then
//!   claims it, or finds the re-driver made it pending and published it: one
//!   extra delivery, which the claim keeps from running the work twice;
//! * after the delete: the re-driver alone drives the retry.

mod reaper;
mod redrive;
mod retry;

use std::fmt;
use std::time::Duration;

use serde_json::Value;
use sqlx::{Connection, PgExecutor};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::json::UnreadableJson;

pub use reaper::{ReapCounts, Reaper, ReaperConfig};
pub use redrive::{RedriveCounts, Redriver, RedriverConfig};
pub use retry::{DeadJobFilter, JobRetry, RetryBy, retries, retry_dead, retry_dead_jobs};

/// The state of a job; see the module docs for transitions and reapers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobStatus {
    /// Runnable once `run_at` has passed. Nobody needs to reap it.
    Pending,
    /// Claimed under a lease. Reaped by the [`Reaper`] when the lease
    /// expires, or taken over then by a [`claim`].
    Processing,
    /// Failed, waiting for its retry at `run_at`. Once that has passed, a
    /// [`claim`] takes it as it takes a due pending job, and the
    /// [`Redriver`] makes it pending again (for [`claim_batch`] pollers,
    /// and for jobs whose message is gone).
    Failed,
    /// Terminal: done, with its result.
    Completed,
    /// Terminal for workers: past its maximum attempts, or cancelled. Only
    /// an operator brings it back ([`retry_dead`]).
    Dead,
}

impl JobStatus {
    /// The name stored in `pgonce.jobs.status`.
    pub const fn as_str(self) -> &'static str {
        match self {
            JobStatus::Pending => "pending",
            JobStatus::Processing => "processing",
            JobStatus::Failed => "failed",
            JobStatus::Completed => "completed",
            JobStatus::Dead => "dead",
        }
    }

    /// Parses a stored status.
    pub fn parse(s: &str) -> Result<JobStatus> {
        Ok(match s {
            "pending" => JobStatus::Pending,
            "processing" => JobStatus::Processing,
            "failed" => JobStatus::Failed,
            "completed" => JobStatus::Completed,
            "dead" => JobStatus::Dead,
            other => {
                return Err(Error::Invalid {
                    what: "job status",
                    why: format!("unknown status {other:?}"),
                });
            }
        })
    }

    /// `completed` and `dead` never change again.
    pub const fn is_terminal(self) -> bool {
        matches!(self, JobStatus::Completed | JobStatus::Dead)
    }
}

impl fmt::Display for JobStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A new job.
#[derive(Debug, Clone)]
pub struct NewJob {
    /// What kind of work; claimers ask for one kind. Non-empty, at most [`MAX_KIND_BYTES`], no NUL.
    pub kind: String,
    /// The work's input.
    pub payload: Value,
    /// Failed attempts allowed before `dead`. Default 5; at least 1.
    pub max_attempts: i32,
    /// Not runnable before this time. Default: now. From 4714-11-24 BC to
    /// the end of 9999 in UTC (what PostgreSQL stores and pgonce reads back).
    pub run_at: Option<OffsetDateTime>,
}

impl NewJob {
    /// A job of `kind` with `payload`, runnable now, allowed 5 failed attempts.
    /// Checked only by [`enqueue`].
    pub fn new(kind: impl Into<String>, payload: Value) -> NewJob {
        NewJob {
            kind: kind.into(),
            payload,
            max_attempts: 5,
            run_at: None,
        }
    }

    /// Sets [`NewJob::max_attempts`]; [`enqueue`] rejects `n < 1`.
    pub fn max_attempts(mut self, n: i32) -> NewJob {
        self.max_attempts = n;
        self
    }
}

/// The longest job kind, in bytes of UTF-8. A kind is the first column of
/// the runnable and dead jobs' indexes, whose entries hold at most 2704
/// bytes once compressed: past that an enqueue fails with SQLSTATE 54000,
/// depending on how well the kind compresses, and inside the caller's
/// transaction the error aborts it. This bound fits whatever the content.
pub const MAX_KIND_BYTES: usize = 1024;

/// Refused before anything reaches the database: empty, longer than
/// [`MAX_KIND_BYTES`], or holding NUL.
fn check_kind(kind: &str) -> Result<()> {
    crate::text::check_key("job kind", kind, MAX_KIND_BYTES)
}

/// Inserts a pending job and returns its id. Rejects a kind PostgreSQL
/// cannot store ([`MAX_KIND_BYTES`]), `max_attempts < 1`, a payload
/// jsonb cannot hold or pgonce could not read back ([`crate::json`]) or
/// whose JSON text is past [`crate::json::MAX_SENT_JSON_BYTES`], or
/// a `run_at` PostgreSQL cannot store or pgonce could not read back
/// (before 4714-11-24 BC, or after 9999 in UTC) before writing anything.
pub async fn enqueue<'c>(db: impl PgExecutor<'c>, job: &NewJob) -> Result<i64> {
    check_kind(&job.kind)?;
    if job.max_attempts < 1 {
        return Err(Error::Invalid {
            what: "max_attempts",
            why: format!("must be at least 1, got {}", job.max_attempts),
        });
    }
    crate::json::check_storable("job payload", &job.payload)?;
    if let Some(run_at) = job.run_at {
        crate::timestamp::check_storable("job run_at", run_at)?;
    }
    let id = sqlx::query_scalar(include_str!("job/sql/enqueue.sql"))
        .bind(&job.kind)
        .bind(crate::json::stored_sendable("job payload", &job.payload)?)
        .bind(job.max_attempts)
        .bind(job.run_at)
        .fetch_one(db)
        .await
        .map_err(|e| crate::json::too_large("job payload", e))?;
    Ok(id)
}

/// The transitions [`transition`] may make (the others need a lease).
const fn transition_allowed(from: JobStatus, to: JobStatus) -> bool {
    matches!(
        (from, to),
        (
            JobStatus::Pending | JobStatus::Failed,
            JobStatus::Completed | JobStatus::Dead
        )
    )
}

/// The conditional transition: moves job `id` from `from` to `to` only if it
/// is still in `from`, in one statement (its row lock is the whole guard).
///
/// Zero rows matched is [`Error::AlreadyHandled`]: another delivery got there
/// first. Allowed: `pending`/`failed` to `completed`/`dead`; anything else
/// is [`Error::Invalid`] (processing is entered by [`claim`] and left through
/// the lease). `result` is stored on the row, `error` in `last_error` (as
/// [`fail`] stores it).
///
/// It guards the state, not the side effect: two racing deliveries that both
/// ran their side effect before calling this both ran it.
pub async fn transition<'c>(
    db: impl PgExecutor<'c>,
    id: i64,
    from: JobStatus,
    to: JobStatus,
    result: Option<&Value>,
    error: Option<&str>,
) -> Result<()> {
    if !transition_allowed(from, to) {
        return Err(Error::Invalid {
            what: "job transition",
            why: format!("{from} to {to} is not a conditional transition"),
        });
    }
    if let Some(result) = result {
        crate::json::check_storable("job result", result)?;
    }
    let result = result
        .map(|r| crate::json::stored_sendable("job result", r))
        .transpose()?;
    // The error travels beside the result, in what the result leaves.
    let result_bytes = result.as_ref().map_or(0, |r| r.0.get().len());
    let done = sqlx::query(include_str!("job/sql/transition.sql"))
        .bind(id)
        .bind(from.as_str())
        .bind(to.as_str())
        .bind(result)
        .bind(error.map(|e| storable_error(e, result_bytes)))
        .execute(db)
        .await
        .map_err(|e| crate::json::too_large("job result", e))?;
    if done.rows_affected() == 0 {
        tracing::debug!(job_id = id, expected = %from, "job already handled");
        metrics::counter!("pgonce_job_already_handled_total").increment(1);
        return Err(Error::AlreadyHandled {
            job_id: id,
            expected: from.as_str(),
        });
    }
    Ok(())
}

/// A claim on a job: the token that fences its completion, and when it
/// expires unless [`heartbeat`] extends it. Consumed by [`complete`] and
/// [`fail`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The claimed job's id.
    pub job_id: i64,
    /// The claim's token: completion, failure and heartbeat match it against
    /// the job's stored token and fail with [`Error::LeaseLost`] once the lease
    /// was taken over.
    pub token: Uuid,
    /// When the lease ends (database clock); after it the [`Reaper`] or a
    /// [`claim`] may hand the job to another worker.
    pub expires_at: OffsetDateTime,
    /// The transaction that took the lease (its 64-bit id,
    /// `pg_current_xact_id()`). [`complete`], [`complete_many`], [`fail`]
    /// and [`heartbeat`] in a transaction whose snapshot predates it cannot
    /// see the lease: they fail with [`Error::SerializationFailure`] (retry
    /// the transaction) rather than [`Error::LeaseLost`]. 0 when unknown (a
    /// lease rebuilt from its token): such a lease is lost wherever it is
    /// not seen. So is one naming a transaction the server has not reached
    /// (a claim still open when the server crashed, or committed with
    /// `synchronous_commit = off` and lost in the crash: recovery hands the
    /// id out again later), one naming an id no server hands out (negative,
    /// or whose low 32 bits are 0, 1 or 2: migration 0300), and one whose
    /// transaction rolled back, even under a snapshot taken while it was
    /// open (migration 0250): no such transaction can still commit it.
    pub claimed_in: i64,
}

impl Lease {
    fn lost(&self) -> Error {
        metrics::counter!("pgonce_job_lease_lost_total").increment(1);
        tracing::warn!(job_id = self.job_id, token = %self.token, "job lease lost");
        Error::LeaseLost {
            resource: format!("job {}", self.job_id),
        }
    }
}

/// The longest lease [`claim`], [`claim_batch`] and [`heartbeat`] take: a
/// year. The lease's end is written, committed, then read back, and a
/// timestamp past year 9999 cannot be read back (sqlx's `time` decoding
/// stops there): a longer lease would commit a claim nobody received, and
/// the job would stay processing under it. Refused before anything is
/// written instead.
pub const MAX_LEASE: Duration = Duration::from_secs(365 * 24 * 3600);

/// The shortest lease [`claim`], [`claim_batch`] and [`heartbeat`] take: a
/// millisecond. The lease's end is the statement's time plus an `interval`,
/// which holds whole microseconds: a lease under half a microsecond would
/// end as it was taken, and the [`Reaper`] could hand the job to another
/// worker while its claimer ran it. Refused before anything is written.
pub const MIN_LEASE: Duration = crate::duration::SHORTEST_LEASE;

fn lease_secs(lease_for: Duration) -> Result<f64> {
    crate::duration::check_within("lease duration", lease_for, MIN_LEASE, MAX_LEASE)?;
    Ok(lease_for.as_secs_f64())
}

/// Phase 1 of two-phase: claims job `id` (to processing) with a lease of
/// `lease_for` when it is due (`run_at` passed) and `pending`, or `failed`
/// with its retry due: a delivery of a failed job's kept message claims it
/// without waiting for the [`Redriver`] (migration 0240). A `processing` job
/// whose lease ran out is taken over as the [`Reaper`] would return it,
/// without waiting for its next pass (migration 0260): the expired attempt
/// is counted (`attempts`, `last_error`), and the old lease is lost. A
/// lease that ran out on the job's last attempt makes the job dead, as the
/// [`Reaper`] would (migration 0290), and the claim answers
/// [`Error::AlreadyHandled`]. Only one delivery can win; the others must
/// not run the side effect, and get:
///
/// * [`Error::AlreadyHandled`] when the job is terminal (`completed`,
///   `dead`, or made dead by this claim) or does not exist: acknowledge
///   the message, the work is done;
/// * [`Error::JobBusy`] when it is not terminal (`processing` under someone
///   else's live lease; `failed` and its retry not yet due,
///   `pending` but not due, or
///   `pending` again because a lease was reaped in between): do **not**
///   acknowledge. The message must come back: if the holder crashes, this
///   redelivered message is what claims the job once its lease has run
///   out. `not_before` says when that can be at the
///   earliest (the lease's expiry, or `run_at`): hide the message until
///   then (the worker runtime does). Each return of the message counts as
///   a receive, so a job held through many heartbeats can send its
///   duplicate message to the dead-letter queue; the job itself is then
///   driven by its holder, and by a `claim_batch` poller if you run one.
///
/// The claim and, when it loses, the read of the job's state run in one
/// call of `pgonce.job_claim`, whose second statement sees the winner's
/// committed state under READ COMMITTED. Under REPEATABLE READ or
/// SERIALIZABLE a claim racing a concurrent one fails with
/// [`Error::SerializationFailure`] first (see the module docs). There the
/// claim reads the job as the transaction's snapshot shows it, and a job
/// enqueued after that snapshot was taken does not exist for it:
/// [`Error::AlreadyHandled`], which a worker acknowledges. Nothing in the
/// snapshot tells such a job from one deleted long ago, so this is not
/// detected: begin (and first read in) the claiming transaction after the
/// job's message was received, as a transaction per message does.
///
/// The claim takes job `id` whatever its kind: the id names one job, and
/// its message was sent for that job (the kind is what [`claim_batch`]
/// pollers, which have no id, ask for). A handler that serves some kinds
/// only, on a queue that carries others too (the [`Redriver`] hands on
/// ids of every kind), reads the job's kind with [`get`] before claiming
/// and leaves the message of a job it does not serve: a job's kind never
/// changes, so reading it first races nothing.
///
/// `db` is a pool (`&pool`) or a connection (`&mut *tx` for a transaction
/// of the caller's, `&mut conn` for a bare one): see [`ClaimBatchOn`]. On
/// a pool the claim is cancel safe: a lease it took for a caller that
/// stopped waiting is given back, by a task the drop hands the claim to, the job
/// pending again, before its connection serves anyone else (module docs,
/// "Cancel safety").
pub async fn claim<'c>(
    db: impl Into<ClaimBatchOn<'c>>,
    id: i64,
    lease_for: Duration,
) -> Result<Lease> {
    let secs = lease_secs(lease_for)?;
    match db.into().0 {
        ClaimBatchTarget::Pool(pool) => {
            crate::transaction::answered_or_given_back(
                pool,
                move |conn| Box::pin(claim_on(conn, id, secs)),
                |conn, lease| Box::pin(async move { give_back(conn, &lease).await }),
            )
            .await
        }
        ClaimBatchTarget::Connection(conn) => claim_on(conn, id, secs).await,
    }
}

/// [`claim`]'s statement and what its row means, on `conn`.
async fn claim_on(conn: &mut sqlx::PgConnection, id: i64, secs: f64) -> Result<Lease> {
    let row: Option<ClaimRow> = sqlx::query_as(include_str!("job/sql/claim.sql"))
        .bind(id)
        .bind(secs)
        .fetch_optional(conn)
        .await?;
    let busy = match row {
        Some(ClaimRow {
            claimed_token: Some(token),
            claimed_until: Some(expires_at),
            claimed_in: Some(claimed_in),
            ..
        }) => {
            metrics::counter!("pgonce_job_claimed_total").increment(1);
            return Ok(Lease {
                job_id: id,
                token,
                expires_at,
                claimed_in,
            });
        }
        Some(ClaimRow {
            found_status: Some(status),
            found_run_at: Some(run_at),
            found_lease_until,
            made_dead,
            ..
        }) => {
            if made_dead == Some(true) {
                metrics::counter!("pgonce_job_dead_total").increment(1);
                tracing::warn!(job_id = id, "lease expired on the last attempt: job dead");
            }
            let status = JobStatus::parse(&status)?;
            let not_before = match status {
                JobStatus::Processing => found_lease_until.unwrap_or(run_at),
                _ => run_at,
            };
            (!status.is_terminal()).then_some((status, not_before))
        }
        _ => None,
    };
    match busy {
        Some((status, not_before)) => {
            metrics::counter!("pgonce_job_busy_total").increment(1);
            tracing::debug!(job_id = id, %status, %not_before, "job busy: message kept");
            Err(Error::JobBusy {
                job_id: id,
                status,
                not_before,
            })
        }
        None => {
            metrics::counter!("pgonce_job_already_handled_total").increment(1);
            Err(Error::AlreadyHandled {
                job_id: id,
                expected: "pending",
            })
        }
    }
}

/// A row of `pgonce.job_claim`: the lease when the claim won, the job's
/// state when it lost.
#[derive(sqlx::FromRow)]
struct ClaimRow {
    claimed_token: Option<Uuid>,
    claimed_until: Option<OffsetDateTime>,
    found_status: Option<String>,
    found_run_at: Option<OffsetDateTime>,
    found_lease_until: Option<OffsetDateTime>,
    claimed_in: Option<i64>,
    /// The claim met a lease that ran out on the job's last attempt and
    /// made the job dead.
    made_dead: Option<bool>,
}

/// Gives back a lease [`claim`] took for a caller that stopped waiting:
/// the job is pending again, with no attempt counted
/// (`job/sql/claim_given_back.sql`).
async fn give_back(conn: &mut sqlx::PgConnection, lease: &Lease) {
    let back: sqlx::Result<Option<i64>> =
        sqlx::query_scalar(include_str!("job/sql/claim_given_back.sql"))
            .bind(lease.job_id)
            .bind(lease.token)
            .fetch_optional(conn)
            .await;
    match back {
        Ok(Some(_)) => {
            metrics::counter!("pgonce_job_claims_given_back_total").increment(1);
            tracing::debug!(
                job_id = lease.job_id,
                "job lease given back: its claimer stopped waiting"
            );
        }
        // Reaped or taken over meanwhile: the lease is no longer the job's.
        Ok(None) => {}
        Err(e) => tracing::warn!(
            job_id = lease.job_id,
            error = %e,
            "job lease taken for a claimer that stopped waiting not given back: \
             the job waits until the lease runs out"
        ),
    }
}

/// A job claimed by [`claim_batch`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClaimedJob {
    /// The job's kind, as given to [`enqueue`].
    pub kind: String,
    /// The job's input, as given to [`enqueue`].
    pub payload: Value,
    /// Failed attempts so far.
    pub attempts: i32,
    /// The claim: pass it to [`complete`], [`fail`] or [`heartbeat`].
    pub lease: Lease,
}

/// Where [`claim`] and [`claim_batch`] run their statement: a pool
/// (`&pool`) or a connection (`&mut *tx` for a transaction of the
/// caller's, `&mut conn` for a bare one).
///
/// On a pool, [`claim`] and [`claim_batch`] give the leases they took
/// back if the caller stopped waiting for them; on a connection they run
/// there, and the caller's transaction is theirs to roll back.
///
/// On a pool, or a connection outside a transaction, [`claim_batch`] runs in a
/// READ COMMITTED transaction of its own, whatever the database's default
/// isolation level: `SKIP LOCKED` then the outer re-check is what keeps
/// concurrent pollers apart, and it is correct at READ COMMITTED. Under a
/// stricter default, a job another poller claimed (or anyone changed)
/// after the statement's snapshot would be a serialization failure
/// instead of a job passed over. In a caller's transaction the claim runs
/// at that transaction's level, whether sqlx began it or a `BEGIN` run as a
/// statement did (a probe of the server's clocks tells, one round trip on a
/// bare connection). On a bare connection the BEGIN is sent on
/// it: a call dropped while that BEGIN is on its way can leave the
/// connection inside a transaction, as sqlx's own `begin` can; on a pool
/// it cannot.
#[derive(Debug)]
pub struct ClaimBatchOn<'c>(ClaimBatchTarget<'c>);

#[derive(Debug)]
enum ClaimBatchTarget<'c> {
    Pool(&'c sqlx::PgPool),
    Connection(&'c mut sqlx::PgConnection),
}

impl<'c> From<&'c sqlx::PgPool> for ClaimBatchOn<'c> {
    fn from(pool: &'c sqlx::PgPool) -> ClaimBatchOn<'c> {
        ClaimBatchOn(ClaimBatchTarget::Pool(pool))
    }
}

impl<'c> From<&'c mut sqlx::PgConnection> for ClaimBatchOn<'c> {
    fn from(conn: &'c mut sqlx::PgConnection) -> ClaimBatchOn<'c> {
        ClaimBatchOn(ClaimBatchTarget::Connection(conn))
    }
}

impl<'c> From<&'c mut sqlx::pool::PoolConnection<sqlx::Postgres>> for ClaimBatchOn<'c> {
    fn from(conn: &'c mut sqlx::pool::PoolConnection<sqlx::Postgres>) -> ClaimBatchOn<'c> {
        ClaimBatchOn(ClaimBatchTarget::Connection(&mut *conn))
    }
}

/// Claims up to `limit` runnable jobs of `kind` in one statement
/// (`FOR UPDATE SKIP LOCKED` in a CTE, then `UPDATE ... RETURNING`), so
/// concurrent workers never claim the same job and never wait for each other.
/// On a pool or a bare connection the statement runs at READ COMMITTED
/// whatever the database's default level (see [`ClaimBatchOn`]).
///
/// A job whose payload cannot be read back (written around [`enqueue`],
/// which refuses such a payload, and nested past
/// [`crate::json::MAX_JSON_NESTING`]) is claimed but not returned: it is
/// logged, counted in `pgonce_job_payload_unreadable_total` (not in
/// `pgonce_job_claimed_total`, which counts the jobs handed back), and left
/// to the [`Reaper`] like a job whose worker died, until it is dead. The rest
/// of the batch is returned: the claim has committed by the time the rows
/// are read, so failing the whole call would leave every job of the batch
/// claimed by nobody.
pub async fn claim_batch<'c>(
    db: impl Into<ClaimBatchOn<'c>>,
    kind: &str,
    limit: i64,
    lease_for: Duration,
) -> Result<Vec<ClaimedJob>> {
    let secs = lease_secs(lease_for)?;
    check_kind(kind)?;
    if limit < 1 {
        return Err(Error::Invalid {
            what: "claim limit",
            why: format!("must be at least 1, got {limit}"),
        });
    }
    let rows = match db.into().0 {
        ClaimBatchTarget::Pool(pool) => {
            let kind = kind.to_owned();
            // On one connection, so that a batch committed for a caller
            // who stopped waiting (dropped while its COMMIT was on its way)
            // is given back at once, its jobs pending again, rather than
            // held by nobody until their leases run out. That connection
            // comes fresh from the pool, outside any transaction, and the
            // work is never dropped midway (a dropped caller hands it to a
            // task that finishes it), so sqlx's BEGIN on it is safe here.
            crate::transaction::answered_or_given_back(
                pool,
                move |conn| {
                    Box::pin(async move {
                        let mut tx = conn
                            .begin_with(crate::IsolationLevel::ReadCommitted.begin())
                            .await?;
                        let rows = claim_batch_rows(&mut tx, &kind, limit, secs).await?;
                        tx.commit().await?;
                        Ok(rows)
                    })
                },
                |conn, rows: Vec<BatchRow>| {
                    Box::pin(async move {
                        for row in &rows {
                            give_back(conn, &row.lease()).await;
                        }
                    })
                },
            )
            .await?
        }
        ClaimBatchTarget::Connection(conn) => {
            crate::transaction::read_committed_unless_in_transaction(conn, async |conn| {
                claim_batch_rows(conn, kind, limit, secs).await
            })
            .await?
        }
    };
    let claimed: Vec<ClaimedJob> = rows
        .into_iter()
        .filter_map(|mut row| match crate::json::read_back(std::mem::take(&mut row.payload)) {
            Ok(payload) => Some(ClaimedJob {
                lease: row.lease(),
                kind: row.kind,
                payload,
                attempts: row.attempts,
            }),
            Err(e) => {
                metrics::counter!("pgonce_job_payload_unreadable_total").increment(1);
                tracing::error!(job_id = row.id, error = %e.why, "job payload unreadable: left to the reaper");
                None
            }
        })
        .collect();
    // The jobs handed back, not the unreadable ones left to the reaper.
    metrics::counter!("pgonce_job_claimed_total").increment(claimed.len() as u64);
    Ok(claimed)
}

/// A job `job/sql/claim_batch.sql` claimed, with its new lease.
#[derive(sqlx::FromRow)]
struct BatchRow {
    id: i64,
    kind: String,
    /// As text, parsed row by row (see [`claim_batch`]).
    payload: String,
    attempts: i32,
    lease_token: Uuid,
    lease_expires_at: OffsetDateTime,
    claimed_in: i64,
}

impl BatchRow {
    /// The lease this row's claim took.
    fn lease(&self) -> Lease {
        Lease {
            job_id: self.id,
            token: self.lease_token,
            expires_at: self.lease_expires_at,
            claimed_in: self.claimed_in,
        }
    }
}

/// [`claim_batch`]'s statement, on `conn` (in a transaction).
async fn claim_batch_rows(
    conn: &mut sqlx::PgConnection,
    kind: &str,
    limit: i64,
    secs: f64,
) -> sqlx::Result<Vec<BatchRow>> {
    sqlx::query_as(include_str!("job/sql/claim_batch.sql"))
        .bind(kind)
        .bind(limit)
        .bind(secs)
        .fetch_all(conn)
        .await
}

/// Phase 2: processing to completed with `result`, only while `lease` is
/// still the job's current lease; otherwise [`Error::LeaseLost`] and nothing
/// is written. Run it in the transaction that writes the work's outcome so
/// both commit together. Under REPEATABLE READ or SERIALIZABLE, in a
/// transaction whose snapshot predates the claim, [`Error::SerializationFailure`]
/// (see the module docs).
pub async fn complete<'c>(db: impl PgExecutor<'c>, lease: &Lease, result: &Value) -> Result<()> {
    crate::json::check_storable("job result", result)?;
    let done: Option<i64> = sqlx::query_scalar(include_str!("job/sql/complete.sql"))
        .bind(lease.job_id)
        .bind(lease.token)
        .bind(crate::json::stored_sendable("job result", result)?)
        .bind(lease.claimed_in)
        .fetch_optional(db)
        .await
        .map_err(|e| crate::json::too_large("job result", e))?;
    if done.is_none() {
        return Err(lease.lost());
    }
    metrics::counter!("pgonce_job_completed_total").increment(1);
    Ok(())
}

/// [`complete`] for many jobs in one statement (one commit), each fenced by
/// its own lease. Returns the ids whose lease was lost (nothing written for
/// those); empty when every job completed. A lease given twice is
/// [`Error::Invalid`], nothing written; so are results whose JSON text,
/// with the 49 bytes each lease sends beside it, passes
/// [`crate::json::MAX_SENT_JSON_BYTES`]. [`Error::SerializationFailure`],
/// nothing written, when one of the leases was taken after the snapshot
/// of the caller's REPEATABLE READ or SERIALIZABLE transaction.
pub async fn complete_many<'c>(
    db: impl PgExecutor<'c>,
    done: &[(Lease, Value)],
) -> Result<Vec<i64>> {
    let mut leases = std::collections::HashSet::with_capacity(done.len());
    for (lease, result) in done {
        crate::json::check_storable("job result", result)?;
        // The same lease twice (a copy renewed by a heartbeat included)
        // would complete its job once, with one of its results, and both
        // would be reported written.
        if !leases.insert((lease.job_id, lease.token)) {
            return Err(Error::Invalid {
                what: "job completions",
                why: format!("the lease on job {} is given twice", lease.job_id),
            });
        }
    }
    let ids: Vec<i64> = done.iter().map(|(l, _)| l.job_id).collect();
    let tokens: Vec<Uuid> = done.iter().map(|(l, _)| l.token).collect();
    // One statement carries them all, with what goes with each: counted
    // before their text is written.
    crate::json::check_sendable_beside(
        "job results",
        done.iter()
            .map(|(_, r)| crate::json::text_lengths(r).stored)
            .sum(),
        done.len() * COMPLETE_MANY_BYTES_PER_LEASE,
    )?;
    let results: Vec<_> = done.iter().map(|(_, r)| crate::json::stored(r)).collect();
    let claimed_in: Vec<i64> = done.iter().map(|(l, _)| l.claimed_in).collect();
    let completed: Vec<CompletedRow> = sqlx::query_as(include_str!("job/sql/complete_many.sql"))
        .bind(&ids)
        .bind(&tokens)
        .bind(&results)
        .bind(&claimed_in)
        .fetch_all(db)
        .await
        .map_err(|e| crate::json::too_large("job results", e))?;
    metrics::counter!("pgonce_job_completed_total").increment(completed.len() as u64);
    // By lease, not by job: a stale lease of a job the same call completed
    // under its current lease wrote nothing, and its caller must hear so.
    let lost: Vec<i64> = done
        .iter()
        .filter(|(l, _)| {
            !completed
                .iter()
                .any(|c| c.job_id == l.job_id && c.token == l.token)
        })
        .map(|(l, _)| {
            // Counted and logged like a single lost completion.
            let _ = l.lost();
            l.job_id
        })
        .collect();
    Ok(lost)
}

/// What [`complete_many`] sends for each lease beside its result's JSON
/// text, as elements of its array parameters: the job id and the claiming
/// transaction (8 bytes each), the token (16), the result's jsonb version
/// byte (1), and each of the four elements' length (4 bytes each).
const COMPLETE_MANY_BYTES_PER_LEASE: usize = 8 + 8 + 16 + 1 + 4 * 4;

/// A completion [`complete_many`] made: the job and the lease it took.
#[derive(sqlx::FromRow)]
struct CompletedRow {
    job_id: i64,
    token: Uuid,
}

/// How failed attempts are retried: delay = min(`max`, `base` *
/// 2^(attempts - 1)) * (1 + `jitter` * U[0, 1)), computed in SQL.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Delay after the first failure. Default 1 s.
    pub base: Duration,
    /// Upper bound before jitter. Default 10 minutes. At least `base`, at
    /// most [`RetryPolicy::LONGEST`].
    pub max: Duration,
    /// Random extra fraction of the delay, in [0, 1]. Default 0.25, so
    /// retries of jobs that failed together spread out.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: Duration::from_secs(1),
            max: Duration::from_secs(600),
            jitter: 0.25,
        }
    }
}

impl RetryPolicy {
    /// The longest `max`: a year. (PostgreSQL's intervals hold far more, but
    /// not `Duration::MAX`, and a retry later than a year is a dead job.)
    pub const LONGEST: Duration = Duration::from_secs(365 * 24 * 3600);

    /// Checks the invariants above.
    pub fn validate(&self) -> Result<()> {
        if self.max < self.base
            || self.max > RetryPolicy::LONGEST
            || !(0.0..=1.0).contains(&self.jitter)
        {
            return Err(Error::Invalid {
                what: "retry policy",
                why: format!(
                    "need base <= max <= 365 days and jitter in [0, 1], got {:?} / {:?} / {}",
                    self.base, self.max, self.jitter
                ),
            });
        }
        Ok(())
    }
}

/// What [`fail`] did with the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailOutcome {
    /// Scheduled for another attempt at `run_at` (the [`Redriver`] will make
    /// it pending then).
    Retry {
        /// Failed attempts so far, this one included.
        attempts: i32,
        /// When the retry is due (database clock).
        run_at: OffsetDateTime,
    },
    /// Past its maximum attempts.
    Dead {
        /// Failed attempts, this one included (at least the job's `max_attempts`).
        attempts: i32,
    },
}

/// Records a failed attempt under `lease`: the error goes to `last_error`,
/// `attempts` is incremented in SQL, and the job is scheduled for a retry by
/// `policy` or, past `max_attempts`, marked dead. [`Error::LeaseLost`] if the
/// lease is no longer current (nothing written); [`Error::SerializationFailure`]
/// under a snapshot older than the claim, as for [`complete`]. The backoff runs from the
/// start of this call's statement, not of its transaction: a failure
/// recorded in a transaction open for a while waits its whole backoff all
/// the same.
///
/// `error` is stored with each NUL character replaced by U+FFFD:
/// PostgreSQL's text cannot hold NUL, and a failure's message comes from
/// whatever failed; recording the failure must not fail on it. So is one
/// past [`crate::json::MAX_SENT_JSON_BYTES`] (PostgreSQL takes a message
/// of at most 1 GiB): cut at the last whole character within it.
pub async fn fail<'c>(
    db: impl PgExecutor<'c>,
    lease: &Lease,
    error: &str,
    policy: &RetryPolicy,
) -> Result<FailOutcome> {
    policy.validate()?;
    /// The job after `job/sql/fail.sql` recorded the failed attempt.
    #[derive(sqlx::FromRow)]
    struct Failed {
        status: String,
        attempts: i32,
        run_at: OffsetDateTime,
    }
    let row: Option<Failed> = sqlx::query_as(include_str!("job/sql/fail.sql"))
        .bind(lease.job_id)
        .bind(lease.token)
        .bind(storable_error(error, 0))
        .bind(policy.base.as_secs_f64())
        .bind(policy.max.as_secs_f64())
        .bind(policy.jitter)
        .bind(lease.claimed_in)
        .fetch_optional(db)
        .await?;
    let Some(Failed {
        status,
        attempts,
        run_at,
    }) = row
    else {
        return Err(lease.lost());
    };
    if status == "dead" {
        metrics::counter!("pgonce_job_dead_total").increment(1);
        tracing::warn!(job_id = lease.job_id, attempts, error, "job dead");
        Ok(FailOutcome::Dead { attempts })
    } else {
        metrics::counter!("pgonce_job_failed_total").increment(1);
        Ok(FailOutcome::Retry { attempts, run_at })
    }
}

/// A failed attempt that [`fail`] recorded, as a handler reports it: the
/// error that failed the work (its [`source`](std::error::Error::source)),
/// with what `fail` did. Return it (or an error caused by it) once `fail`
/// has committed; never for a `fail` run in a transaction that has not.
///
/// It tells the queue worker that the job's row holds the failure. Under
/// [`crate::queue::AckPolicy::AlwaysDelete`] the worker deletes the
/// message then, whatever failed the work: the row is the retry ledger, and
/// the [`Redriver`] makes the job pending once its retry is due (or it is
/// dead). Without it, a failure caused by an error that records nothing
/// (a serialization failure, [`Error::LockNotAvailable`],
/// [`Error::QueryCanceled`]) kept the message, and the job, driven by that
/// message and by the re-driver both, was delivered twice per attempt.
#[derive(Debug)]
pub struct FailureRecorded {
    /// The job whose attempt failed.
    pub job_id: i64,
    /// What [`fail`] did: a retry scheduled, or the job dead.
    pub outcome: FailOutcome,
    cause: Box<dyn std::error::Error + Send + Sync>,
}

impl FailureRecorded {
    /// The failure of job `job_id`'s attempt, caused by `cause`, which
    /// [`fail`] recorded with `outcome`.
    pub fn new(
        job_id: i64,
        outcome: FailOutcome,
        cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> FailureRecorded {
        FailureRecorded {
            job_id,
            outcome,
            cause: cause.into(),
        }
    }
}

impl fmt::Display for FailureRecorded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            FailOutcome::Retry { attempts, run_at } => write!(
                f,
                "job {} failed (attempt {attempts}, retried at {run_at})",
                self.job_id
            ),
            FailOutcome::Dead { attempts } => write!(
                f,
                "job {} failed (attempt {attempts}, now dead)",
                self.job_id
            ),
        }
    }
}

impl std::error::Error for FailureRecorded {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.cause)
    }
}

/// A failure's message as `last_error` can hold it and one statement can
/// send it beside `beside` bytes of JSON text: NUL, which text cannot
/// hold, becomes U+FFFD; past what [`crate::json::MAX_SENT_JSON_BYTES`]
/// leaves it is cut at the last whole character that fits (PostgreSQL
/// takes a message of at most 1 GiB, and past it dropped the connection:
/// the failure went unrecorded).
fn storable_error(error: &str, beside: usize) -> std::borrow::Cow<'_, str> {
    let room = crate::json::MAX_SENT_JSON_BYTES.saturating_sub(beside);
    let mut error: std::borrow::Cow<'_, str> = if error.contains('\0') {
        error.replace('\0', "\u{FFFD}").into()
    } else {
        error.into()
    };
    if error.len() > room {
        let end = error.floor_char_boundary(room);
        error.to_mut().truncate(end);
    }
    error
}

/// Extends a live lease to `extend_by` past the start of this call's
/// statement (not of its transaction: a heartbeat run in a transaction
/// open for a while extends from now all the same) and returns the renewed
/// lease;
/// [`Error::LeaseLost`] if it was taken over ([`Error::SerializationFailure`]
/// under a snapshot older than the claim, as for [`complete`]). Call it
/// well within the lease
/// so slow work is not reaped and run twice merely for being slow.
pub async fn heartbeat<'c>(
    db: impl PgExecutor<'c>,
    lease: &Lease,
    extend_by: Duration,
) -> Result<Lease> {
    let secs = lease_secs(extend_by)?;
    let row: Option<OffsetDateTime> = sqlx::query_scalar(include_str!("job/sql/heartbeat.sql"))
        .bind(lease.job_id)
        .bind(lease.token)
        .bind(secs)
        .bind(lease.claimed_in)
        .fetch_optional(db)
        .await?;
    match row {
        Some(expires_at) => Ok(Lease {
            expires_at,
            ..lease.clone()
        }),
        None => Err(lease.lost()),
    }
}

/// A job row as stored.
///
/// A payload or result that cannot be read back (written around
/// [`enqueue`] or [`complete`], which refuse one, and nested past
/// [`crate::json::MAX_JSON_NESTING`]) is an [`UnreadableJson`] holding its
/// text: the rest of the row reads all the same, so an operator can see
/// what such a job is, where it stands, and what was stored.
///
/// A time written by hand past what pgonce reads back (PostgreSQL's
/// `infinity` or `-infinity` in `run_at` or `lease_expires_at`) reads as
/// the nearest end of that range: 4714-11-24 BC, or the end of 9999 in
/// UTC. [`claim`]'s [`Error::JobBusy`] and [`fail`] read them the same way.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct JobRow {
    /// The job's id, as [`enqueue`] returned it.
    pub id: i64,
    /// What kind of work it is.
    pub kind: String,
    /// The work's input, or the text of one that cannot be read back.
    pub payload: std::result::Result<Value, UnreadableJson>,
    /// The stored status name; [`JobRow::status`] parses it.
    pub status: String,
    /// Failed attempts so far (reaped leases count as failures).
    pub attempts: i32,
    /// Failed attempts allowed before the job is dead.
    pub max_attempts: i32,
    /// The current claim's token; `None` unless the job is processing.
    pub lease_token: Option<Uuid>,
    /// When the current claim's lease ends; `None` unless the job is processing.
    pub lease_expires_at: Option<OffsetDateTime>,
    /// Not runnable before this time: the enqueue time or the next retry.
    pub run_at: OffsetDateTime,
    /// What the completing worker stored (or the text of what cannot be
    /// read back); `None` until completed.
    pub result: Option<std::result::Result<Value, UnreadableJson>>,
    /// The last failure's message, if any attempt failed.
    pub last_error: Option<String>,
}

impl JobRow {
    /// The status as a [`JobStatus`]; [`Error::Invalid`] for a name this
    /// version does not know.
    pub fn status(&self) -> Result<JobStatus> {
        JobStatus::parse(&self.status)
    }
}

/// Reads job `id`, if it exists, even when its payload or result cannot
/// be read back (see [`JobRow`]).
pub async fn get<'c>(db: impl PgExecutor<'c>, id: i64) -> Result<Option<JobRow>> {
    /// A row of `job/sql/get.sql`: the JSON columns as text, read back
    /// one by one.
    #[derive(sqlx::FromRow)]
    struct Stored {
        id: i64,
        kind: String,
        payload: String,
        status: String,
        attempts: i32,
        max_attempts: i32,
        lease_token: Option<Uuid>,
        lease_expires_at: Option<OffsetDateTime>,
        run_at: OffsetDateTime,
        result: Option<String>,
        last_error: Option<String>,
    }
    let row: Option<Stored> = sqlx::query_as(include_str!("job/sql/get.sql"))
        .bind(id)
        .fetch_optional(db)
        .await?;
    Ok(row.map(|row| JobRow {
        id: row.id,
        kind: row.kind,
        payload: crate::json::read_back(row.payload),
        status: row.status,
        attempts: row.attempts,
        max_attempts: row.max_attempts,
        lease_token: row.lease_token,
        lease_expires_at: row.lease_expires_at,
        run_at: row.run_at,
        result: row.result.map(crate::json::read_back),
        last_error: row.last_error,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unleased_transitions_are_conditional_transitions() {
        use JobStatus::*;
        assert!(transition_allowed(Pending, Completed));
        assert!(transition_allowed(Failed, Dead));
        assert!(!transition_allowed(Pending, Processing));
        assert!(!transition_allowed(Processing, Completed));
        assert!(!transition_allowed(Completed, Pending));
    }

    #[test]
    fn statuses_round_trip() {
        for s in [
            JobStatus::Pending,
            JobStatus::Processing,
            JobStatus::Failed,
            JobStatus::Completed,
            JobStatus::Dead,
        ] {
            assert_eq!(JobStatus::parse(s.as_str()).unwrap(), s);
        }
        assert!(JobStatus::parse("bogus").is_err());
    }
}
