//! Operator retries of dead jobs: once the cause of a job's death is fixed
//! (a bad credential, a remote service down for a day), bring it back.
//!
//! The [`crate::job::Redriver`] takes `failed` jobs only: `dead` is terminal
//! for the workers, so nothing automatic ever revives a job. A retry is an
//! operator's decision, recorded in `pgonce.job_retries` with who made it,
//! when, why, and what the job had been (attempts, last error, since when
//! dead).
//!
//! A retried job is `pending` again with `attempts = 0` (a fresh set of
//! `max_attempts`; the audit row keeps the old count) and `run_at = now()`.
//! It runs exactly once more, like any pending job: workers claim it
//! ([`crate::job::claim_batch`] pollers find it at once; with queue-driven
//! workers publish one message per returned id, as for the re-driver's ids).
//!
//! Concurrent retriers of the same job serialize on its row: one retries it
//! and writes one audit row; the other finds it no longer dead. The other
//! waits for the first's transaction within the `lock_timeout` its session
//! inherited, if any (an operator's `ALTER ROLE ... SET lock_timeout`):
//! past it, [`Error::LockNotAvailable`] with nothing retried; run it again
//! once the first retrier's transaction has ended.
//!
//! Retrying a job that is not dead is a typed refusal for a single job
//! ([`Error::JobNotDead`], nothing written) and, for a filtered set, simply
//! not a match: only dead jobs are ever selected.

use sqlx::PgConnection;
use time::OffsetDateTime;

use crate::error::{Error, Result};

/// Which dead jobs [`retry_dead_jobs`] brings back. Every field narrows the
/// set; the default is every dead job, oldest death first, up to 1000.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadJobFilter {
    /// Only jobs of this kind.
    pub kind: Option<String>,
    /// Only jobs that died at or after this time. Like `dead_before`, from
    /// 4714-11-24 BC to the end of 9999 in UTC, or [`Error::Invalid`].
    pub dead_since: Option<OffsetDateTime>,
    /// Only jobs that died before this time.
    pub dead_before: Option<OffsetDateTime>,
    /// At most this many jobs per call. Default 1000; at least 1.
    pub limit: i64,
}

impl Default for DeadJobFilter {
    fn default() -> Self {
        DeadJobFilter {
            kind: None,
            dead_since: None,
            dead_before: None,
            limit: 1000,
        }
    }
}

/// Who retries, and why; stored in the audit row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryBy<'a> {
    /// The operator (a user name, a service account). Non-empty.
    pub who: &'a str,
    /// Why, for whoever reads the audit later.
    pub reason: Option<&'a str>,
}

/// One row of `pgonce.job_retries`. A time written by hand past what
/// pgonce reads back (PostgreSQL's `infinity` or `-infinity`, in the audit
/// row or in the dead job's `finished_at` it copied) reads as the nearest
/// end of that range, as in [`crate::job::JobRow`].
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct JobRetry {
    /// The audit row's id.
    pub id: i64,
    /// The dead job that was made pending again.
    pub job_id: i64,
    /// The operator, as given in [`RetryBy::who`].
    pub retried_by: String,
    /// Why, as given in [`RetryBy::reason`].
    pub reason: Option<String>,
    /// When the retry was recorded (database clock).
    pub retried_at: OffsetDateTime,
    /// Failed attempts the job had when it was retried.
    pub previous_attempts: i32,
    /// Its `last_error` then (kept on the job too).
    pub previous_error: Option<String>,
    /// When it had died.
    pub dead_since: OffsetDateTime,
}

/// Refused before any statement (a database error would abort the
/// caller's transaction): no operator, or NUL (which SQL text cannot hold)
/// in the operator or the reason.
fn check_by(by: &RetryBy<'_>) -> Result<()> {
    let why = if by.who.is_empty() {
        "who retries must not be empty"
    } else if by.who.contains('\0') || by.reason.is_some_and(|r| r.contains('\0')) {
        "who retries and why must contain no NUL character (SQL text cannot hold it)"
    } else {
        return Ok(());
    };
    Err(Error::invalid("job retry", why))
}

async fn run(
    conn: &mut PgConnection,
    id: Option<i64>,
    filter: &DeadJobFilter,
    by: &RetryBy<'_>,
) -> Result<Vec<i64>> {
    let ids: Vec<i64> = sqlx::query_scalar(include_str!("sql/retry_dead.sql"))
        .bind(id)
        .bind(filter.kind.as_deref())
        .bind(filter.dead_since)
        .bind(filter.dead_before)
        .bind(filter.limit)
        .bind(by.who)
        .bind(by.reason)
        .fetch_all(conn)
        .await?;
    if !ids.is_empty() {
        tracing::info!(retried = ids.len(), by = by.who, "dead jobs retried");
        metrics::counter!("pgonce_job_retried_total").increment(ids.len() as u64);
    }
    Ok(ids)
}

/// Retries dead job `id`: back to `pending` with a fresh set of attempts,
/// audited. [`Error::JobNotDead`] (nothing written) when the job is not
/// dead, including when a concurrent retrier got there first, or does not
/// exist (`status: None`).
///
/// Takes a connection (`&mut *tx` to retry inside a transaction): a refusal
/// reads the job's state with a second statement, which under READ
/// COMMITTED sees a concurrent retrier's committed work. A transaction
/// begun by a `BEGIN` run as a statement counts as one. On a connection
/// outside a transaction both statements run in a READ COMMITTED
/// transaction of their own, whatever the database's default level; a call
/// dropped while its BEGIN is on its way can leave the connection inside
/// that transaction, as sqlx's own `begin` can: close such a connection.
pub async fn retry_dead(conn: &mut PgConnection, id: i64, by: RetryBy<'_>) -> Result<()> {
    check_by(&by)?;
    let filter = DeadJobFilter {
        limit: 1,
        ..DeadJobFilter::default()
    };
    crate::transaction::read_committed_unless_in_transaction(conn, async |conn| {
        if !run(conn, Some(id), &filter, &by).await?.is_empty() {
            return Ok(());
        }
        let status = match super::get(&mut *conn, id).await? {
            Some(row) => Some(row.status()?),
            None => None,
        };
        Err(Error::JobNotDead { job_id: id, status })
    })
    .await
}

/// Retries the dead jobs `filter` selects (oldest death first, at most
/// `filter.limit`) and returns their ids, for publishing a message per job.
/// Jobs that are not dead are never selected: retrying them is a no-op.
pub async fn retry_dead_jobs(
    conn: &mut PgConnection,
    filter: &DeadJobFilter,
    by: RetryBy<'_>,
) -> Result<Vec<i64>> {
    check_by(&by)?;
    if let Some(kind) = &filter.kind {
        super::check_kind(kind)?;
    }
    for bound in [filter.dead_since, filter.dead_before]
        .into_iter()
        .flatten()
    {
        crate::timestamp::check_storable("dead job filter", bound)?;
    }
    if filter.limit < 1 {
        return Err(Error::Invalid {
            what: "dead job filter",
            why: format!("limit must be at least 1, got {}", filter.limit),
        });
    }
    crate::transaction::read_committed_unless_in_transaction(conn, async |conn| {
        run(conn, None, filter, &by).await
    })
    .await
}

/// The audit of job `id`'s retries, oldest first.
pub async fn retries(conn: &mut PgConnection, id: i64) -> Result<Vec<JobRetry>> {
    Ok(sqlx::query_as(include_str!("sql/retries.sql"))
        .bind(id)
        .fetch_all(conn)
        .await?)
}
