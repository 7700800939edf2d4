//! Maintenance: nothing the library writes grows without bound.
//!
//! Jobs that finished, dead-letter messages nobody reads, deduplication
//! claims, idempotency keys and processed-message keys would otherwise stay
//! forever. One loop ([`Maintenance::spawn`], or [`run_once`] for a single
//! pass) runs a cleaner per kind of row, each with its own retention in
//! [`MaintenanceConfig`] (`None` keeps that kind forever).
//!
//! # How a cleaner deletes
//!
//! Each batch is one statement, in a READ COMMITTED transaction of its own
//! whatever the database's default isolation level (under a stricter one a
//! row changed since the statement's snapshot would fail the pass with
//! 40001): `DELETE ... USING (SELECT ... ORDER BY age
//! LIMIT batch_size FOR UPDATE SKIP LOCKED)`, over an index on the age column
//! restricted to the rows the cleaner may take (migration 0100). So a batch
//! holds at most `batch_size` row locks for one statement, never waits for a
//! row someone else is changing (it is skipped and left to the next pass),
//! and never scans live rows. A cleaner repeats batches, yielding to the
//! runtime between them, until one comes back short.
//!
//! # Why each bound is safe
//!
//! * **Completed jobs** (default 24 h after `finished_at`): terminal, nothing
//!   transitions a completed job again. A duplicate delivery arriving after
//!   the row is gone loses its claim with [`Error::AlreadyHandled`], exactly
//!   as against the completed row (the claim treats a missing job as done),
//!   and acknowledges its message.
//! * **Dead jobs** (default 7 days): terminal until an operator retries
//!   them; 7 days leaves a week to look. A retry in progress holds the row's
//!   lock and is skipped; once retried the job is pending and out of reach.
//!   Its `job_retries` audit rows go with it.
//! * **Queue deduplication claims** (default: as soon as their window ended,
//!   grace 0): a claim past `expires_at` already deduplicates nothing (a
//!   send renews it as if absent), so deleting it changes no outcome.
//! * **Dead-letter messages** (default 14 days after `sent_at`, SQS's
//!   maximum retention, which SQS also counts from the original send): only
//!   messages the dead-letter rule moved and nobody redrove
//!   (`dead_lettered_from` set), and only while no consumer has one in
//!   flight. Messages in ordinary queues are never touched: the receive path
//!   expires those by their queue's own retention, and it still applies the
//!   dead-letter queue's retention to a message received from there, so a
//!   dead-letter message lives until the earlier of the two.
//! * **Idempotency keys** (default 24 h after first use, what clients are
//!   told a retry may take): a key still held (`in_progress` with a hold
//!   that has not expired) is never taken, whatever its age.
//! * **Processed-message keys** (default 7 days): must outlast the longest
//!   time a message can be redelivered after its first processing (the
//!   queue's retention), or a late duplicate is applied again.
//!
//! # Running it
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> pgonce::Result<()> {
//! use pgonce::maintenance::{Maintenance, MaintenanceConfig};
//! let handle = Maintenance::spawn(pool, MaintenanceConfig::default())?;
//! // ... serve ...
//! handle.stop().await; // finishes the statement in flight, then returns
//! # Ok(()) }
//! ```
//!
//! Several processes may run it at once: the batches skip each other's rows.
//! Every deleted row is counted in `pgonce_maintenance_deleted_total{table}`,
//! with `table` one of the [`Cleaner`] labels.

use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;

/// Retention per kind of row, and how the loop runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaintenanceConfig {
    /// Pause between passes of the loop. Default 60 s; non-zero.
    pub interval: Duration,
    /// Rows deleted per statement. Default 1000; at least 1.
    pub batch_size: i64,
    /// Completed jobs, after `finished_at`. Default 24 h.
    pub completed_jobs: Option<Duration>,
    /// Dead jobs, after `finished_at`. Default 7 days.
    pub dead_jobs: Option<Duration>,
    /// Queue deduplication claims, after their window ended. Default 0.
    pub queue_dedup: Option<Duration>,
    /// Messages in a dead-letter queue, after `sent_at`. Default 14 days.
    pub dead_letter_messages: Option<Duration>,
    /// Idempotency keys, after `created_at` (and never while held).
    /// Default 24 h.
    pub idempotency_keys: Option<Duration>,
    /// Processed-message keys, after `processed_at`. Default 7 days.
    pub processed_messages: Option<Duration>,
}

/// The longest retention a cleaner takes: a thousand years. A cleaner
/// deletes what is older than `now()` minus its retention, and PostgreSQL's
/// timestamps start in 4713 BC: with a retention of several thousand years
/// every pass would fail ("timestamp out of range") and delete nothing. To
/// keep a kind of row for good, leave its cleaner out (`None`).
pub const MAX_RETENTION: Duration = Duration::from_secs(1000 * 365 * DAY);

const HOUR: u64 = 3600;
const DAY: u64 = 24 * HOUR;

impl Default for MaintenanceConfig {
    fn default() -> Self {
        MaintenanceConfig {
            interval: Duration::from_secs(60),
            batch_size: 1000,
            completed_jobs: Some(Duration::from_secs(24 * HOUR)),
            dead_jobs: Some(Duration::from_secs(7 * DAY)),
            queue_dedup: Some(Duration::ZERO),
            dead_letter_messages: Some(Duration::from_secs(14 * DAY)),
            idempotency_keys: Some(Duration::from_secs(24 * HOUR)),
            processed_messages: Some(Duration::from_secs(7 * DAY)),
        }
    }
}

impl MaintenanceConfig {
    /// Every retention `None`: a config that deletes nothing, to switch
    /// single cleaners on.
    pub fn keep_everything() -> MaintenanceConfig {
        MaintenanceConfig {
            completed_jobs: None,
            dead_jobs: None,
            queue_dedup: None,
            dead_letter_messages: None,
            idempotency_keys: None,
            processed_messages: None,
            ..MaintenanceConfig::default()
        }
    }

    /// Checks the interval, the batch size and each retention (at most
    /// [`MAX_RETENTION`]).
    pub fn validate(&self) -> Result<()> {
        crate::service::check_config("maintenance config", self.interval, self.batch_size)?;
        [
            self.completed_jobs,
            self.dead_jobs,
            self.queue_dedup,
            self.dead_letter_messages,
            self.idempotency_keys,
            self.processed_messages,
        ]
        .into_iter()
        .flatten()
        .try_for_each(|retention| crate::service::check_retention("maintenance config", retention))
    }
}

/// One kind of row the loop cleans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cleaner {
    /// Completed jobs past [`MaintenanceConfig::completed_jobs`].
    CompletedJobs,
    /// Dead jobs past [`MaintenanceConfig::dead_jobs`].
    DeadJobs,
    /// Queue deduplication claims past [`MaintenanceConfig::queue_dedup`].
    QueueDedup,
    /// Dead-letter messages past [`MaintenanceConfig::dead_letter_messages`].
    DeadLetterMessages,
    /// Idempotency keys past [`MaintenanceConfig::idempotency_keys`].
    IdempotencyKeys,
    /// Processed-message keys past [`MaintenanceConfig::processed_messages`].
    ProcessedMessages,
}

impl Cleaner {
    /// The `table` label of its metric.
    pub fn label(self) -> &'static str {
        match self {
            Cleaner::CompletedJobs => "jobs_completed",
            Cleaner::DeadJobs => "jobs_dead",
            Cleaner::QueueDedup => "queue_dedup",
            Cleaner::DeadLetterMessages => "queue_dead_letter",
            Cleaner::IdempotencyKeys => "idempotency_keys",
            Cleaner::ProcessedMessages => "processed_messages",
        }
    }

    /// One batch: binds the retention in seconds ($1) and the batch size ($2).
    fn sql(self) -> &'static str {
        match self {
            Cleaner::CompletedJobs => include_str!("maintenance/sql/completed_jobs.sql"),
            Cleaner::DeadJobs => include_str!("maintenance/sql/dead_jobs.sql"),
            Cleaner::QueueDedup => include_str!("maintenance/sql/queue_dedup.sql"),
            Cleaner::DeadLetterMessages => {
                include_str!("maintenance/sql/dead_letter_messages.sql")
            }
            Cleaner::IdempotencyKeys => include_str!("dedupe/sql/collect_keys.sql"),
            Cleaner::ProcessedMessages => include_str!("dedupe/sql/collect_processed.sql"),
        }
    }
}

/// What one pass deleted, per cleaner, and how many statements it took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleanedCounts {
    /// Completed jobs deleted.
    pub completed_jobs: u64,
    /// Dead jobs deleted.
    pub dead_jobs: u64,
    /// Queue deduplication claims deleted.
    pub queue_dedup: u64,
    /// Messages deleted from dead-letter queues.
    pub dead_letter_messages: u64,
    /// Idempotency keys deleted.
    pub idempotency_keys: u64,
    /// Processed-message keys deleted.
    pub processed_messages: u64,
    /// DELETE statements run (cleaners set to `None` run none).
    pub batches: u64,
}

impl CleanedCounts {
    /// Rows deleted in all.
    pub fn total(&self) -> u64 {
        self.completed_jobs
            + self.dead_jobs
            + self.queue_dedup
            + self.dead_letter_messages
            + self.idempotency_keys
            + self.processed_messages
    }
}

/// One pass: every cleaner with a retention deletes what is past it, batch
/// by batch, until a batch comes back short. Validates `config` first.
pub async fn run_once(pool: &PgPool, config: &MaintenanceConfig) -> Result<CleanedCounts> {
    config.validate()?;
    let mut counts = CleanedCounts::default();
    let CleanedCounts {
        completed_jobs,
        dead_jobs,
        queue_dedup,
        dead_letter_messages,
        idempotency_keys,
        processed_messages,
        batches,
    } = &mut counts;
    let plan = [
        (
            Cleaner::CompletedJobs,
            config.completed_jobs,
            completed_jobs,
        ),
        (Cleaner::DeadJobs, config.dead_jobs, dead_jobs),
        (Cleaner::QueueDedup, config.queue_dedup, queue_dedup),
        (
            Cleaner::DeadLetterMessages,
            config.dead_letter_messages,
            dead_letter_messages,
        ),
        (
            Cleaner::IdempotencyKeys,
            config.idempotency_keys,
            idempotency_keys,
        ),
        (
            Cleaner::ProcessedMessages,
            config.processed_messages,
            processed_messages,
        ),
    ];
    for (cleaner, retention, deleted) in plan {
        let Some(retention) = retention else {
            continue;
        };
        loop {
            let n = crate::transaction::read_committed(pool, async |conn| {
                sqlx::query(cleaner.sql())
                    .bind(retention.as_secs_f64())
                    .bind(config.batch_size)
                    .execute(conn)
                    .await
            })
            .await?
            .rows_affected();
            *batches += 1;
            *deleted += n;
            metrics::counter!("pgonce_maintenance_deleted_total", "table" => cleaner.label())
                .increment(n);
            if (n as i64) < config.batch_size {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
    if counts.total() > 0 {
        tracing::info!(?counts, "maintenance pass deleted rows past retention");
    }
    Ok(counts)
}

/// Runs a pass every `config.interval` until `shutdown` completes. A failed
/// pass is counted and logged (the first, then a line a minute at most,
/// then the recovery: [`crate::service`]) and the next one tried. Validates `config` first. A pass
/// in progress when `shutdown` completes is dropped at its current
/// statement, a transaction of its own, which rolls back: nothing is left
/// half deleted, and a delete waiting on a lock does not hold the stop.
pub async fn run(
    pool: PgPool,
    config: MaintenanceConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    config.validate()?;
    // The loop is raced against `shutdown` rather than handed it: it looks
    // at its shutdown between passes only, so a pass waiting on a lock
    // held the stop for as long as the lock was held.
    let passes = crate::service::run_every(
        "maintenance",
        config.interval,
        std::future::pending(),
        || run_once(&pool, &config),
    );
    tokio::select! {
        () = passes => {}
        () = shutdown => {}
    }
    Ok(())
}

/// The maintenance loop as a background task.
pub struct Maintenance;

impl Maintenance {
    /// Validates `config` and spawns [`run`] on the current Tokio runtime.
    /// Stop it with [`MaintenanceHandle::stop`].
    pub fn spawn(pool: PgPool, config: MaintenanceConfig) -> Result<MaintenanceHandle> {
        config.validate()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let shutdown = async move {
                // A dropped handle stops the loop as well.
                let _ = stopped.await;
            };
            if let Err(e) = run(pool, config, shutdown).await {
                tracing::error!(error = %e, "maintenance loop refused its config");
            }
        });
        Ok(MaintenanceHandle { stop, task })
    }
}

/// The running loop of [`Maintenance::spawn`].
#[derive(Debug)]
pub struct MaintenanceHandle {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl MaintenanceHandle {
    /// Stops the loop and waits for it: a pass in progress is dropped at its
    /// current statement, which is atomic, so nothing is left half deleted.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "maintenance loop ended abnormally");
        }
    }
}
