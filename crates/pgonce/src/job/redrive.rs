//! The re-driver: the DB-driven retry loop. Failed jobs whose backoff has
//! passed (`run_at <= now()`) become `pending` again. The row, not the queue,
//! is the retry ledger: with [`crate::queue::AckPolicy::AlwaysDelete`] the message
//! of a failed job is gone, and the ids this returns are what a queue worker
//! re-publishes: [`Redriver::run_handing_on`] hands them on before each
//! batch commits, so none is lost to a failed publish or a dead process.
//! A delivery of a failed job's kept message may claim it
//! first, once due ([`crate::job::claim`] takes a due failed job); the
//! re-driver then passes it over.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use sqlx::PgPool;

use crate::error::Result;

/// Settings of the [`Redriver`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriverConfig {
    /// Pause between passes of [`Redriver::run`]. Default 1 s; non-zero.
    pub interval: Duration,
    /// Jobs re-driven per statement. Default 1000; at least 1.
    pub batch_size: i64,
    /// How long [`Redriver::run_handing_on`]'s hand-on may take for one
    /// batch before it is given up (its future dropped) and the batch
    /// rolled back, as for a failed hand-on. Default 60 s; non-zero. A
    /// hand-on that never returns (a publish waiting on a peer that does
    /// not answer) would otherwise stop the loop for good with the batch's
    /// rows locked. Keep it below the server's
    /// `idle_in_transaction_session_timeout`, if set: the batch's
    /// transaction idles while the hand-on runs.
    pub hand_on_timeout: Duration,
}

impl Default for RedriverConfig {
    fn default() -> Self {
        RedriverConfig {
            interval: Duration::from_secs(1),
            batch_size: 1000,
            hand_on_timeout: Duration::from_secs(60),
        }
    }
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedriveCounts {
    /// Jobs made pending again.
    pub redriven: u64,
    /// Their ids, for re-publishing a message per job.
    pub ids: Vec<i64>,
}

/// Makes due failed jobs runnable; see the module docs.
#[derive(Debug, Clone)]
pub struct Redriver {
    pool: PgPool,
    config: RedriverConfig,
}

impl Redriver {
    /// Validates `config`.
    pub fn new(pool: PgPool, config: RedriverConfig) -> Result<Redriver> {
        crate::service::check_config("redriver config", config.interval, config.batch_size)?;
        if config.hand_on_timeout.is_zero() {
            return Err(crate::Error::Invalid {
                what: "redriver config",
                why: "need a non-zero hand_on_timeout".into(),
            });
        }
        Ok(Redriver { pool, config })
    }

    /// One pass: every failed job due by now becomes pending, batch by
    /// batch, each batch committed on its own. A batch that fails after
    /// others committed ends the pass with what they made pending (the
    /// failure is logged): those jobs are pending already, and their ids
    /// are the only record of which to re-publish. The next pass takes the
    /// rest. A pass whose first batch fails returns the error.
    ///
    /// The ids come back after their batch committed: a caller that fails
    /// to publish them, or dies first, leaves those jobs pending with no
    /// message. [`Redriver::run_handing_on`] hands each batch on before it
    /// commits instead.
    pub async fn run_once(&self) -> Result<RedriveCounts> {
        let no_hand_on = |_| std::future::ready(Ok::<(), std::convert::Infallible>(()));
        match self.pass(no_hand_on).await {
            Ok(counts) => Ok(counts),
            Err(BatchFailed::Database(e)) => Err(e),
            Err(BatchFailed::HandOn(never)) => match never {},
        }
    }

    /// Runs a pass every `interval` until `shutdown` completes, the ids of
    /// the jobs each makes pending dropped: for jobs that need no message
    /// ([`crate::job::claim_batch`] pollers take pending jobs). Queue-driven
    /// workers need one per job: [`Redriver::run_handing_on`]. A failed
    /// pass is counted and logged (the first, then a line a minute at
    /// most, then the recovery: [`crate::service`]).
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        crate::service::run_every("redriver", self.config.interval, shutdown, || {
            self.run_once()
        })
        .await;
    }

    /// Runs a pass every `interval` until `shutdown` completes, handing the
    /// ids of each batch to `hand_on` (to publish a message per job) inside
    /// the batch's transaction, and committing the batch only once
    /// `hand_on` returned `Ok`. No job is made pending without its id
    /// handed on:
    ///
    /// * `hand_on` fails, panics or runs past
    ///   [`RedriverConfig::hand_on_timeout`] (its future is then dropped):
    ///   the batch is rolled back, its jobs stay failed and due, the pass
    ///   fails (counted and logged with the error, the panic's message or
    ///   the timeout, as every failed pass is: [`crate::service`]) and
    ///   the next pass hands them on again (ids a hand-on given up had
    ///   already published go out twice, duplicates the claim keeps from
    ///   running the work twice);
    /// * the process dies (or this future is dropped) before the commit:
    ///   the transaction is rolled back likewise, and the next pass (of any
    ///   re-driver) hands them on again;
    /// * the commit fails after `hand_on` succeeded: the jobs stay failed
    ///   and due, and their messages are out: a message claims a due
    ///   failed job as it claims a pending one ([`crate::job::claim`]),
    ///   and the next pass hands them on a second time, a duplicate the
    ///   claim keeps from running the work twice.
    ///
    /// So each id is handed on at least once per re-drive, never zero
    /// times. Until the batch commits its jobs' rows stay locked: a claim
    /// of one (a message published by `hand_on`, received at once) waits
    /// for the commit, then claims the pending job; other passes skip
    /// them. Keep `hand_on` short, and give the pool a connection beyond
    /// the one the pass holds if `hand_on` uses it (a send to a
    /// [`crate::PgQueue`] on the same pool). `shutdown` stops the loop
    /// between passes: a pass under way, its hand-on included, ends first.
    pub async fn run_handing_on<E, Fut>(
        self,
        shutdown: impl Future<Output = ()>,
        hand_on: impl FnMut(Vec<i64>) -> Fut,
    ) where
        E: std::fmt::Display,
        Fut: Future<Output = std::result::Result<(), E>>,
    {
        // Each pass's future borrows `hand_on` mutably, and a closure
        // cannot lend out what it captured past its own call: the passes
        // take turns through a lock instead (never contended, one pass at
        // a time). tokio's, whose guard may be held across the awaits of a
        // task that moves between threads.
        let hand_on = tokio::sync::Mutex::new(hand_on);
        crate::service::run_every("redriver", self.config.interval, shutdown, || async {
            let mut hand_on = hand_on.lock().await;
            // A panic in the hand-on (its call or its future) is a failed
            // hand-on: it would otherwise end the loop, and under
            // AlwaysDelete a failed job has no message, only the next
            // pass to drive it. Its batch rolls back all the same, the
            // transaction dropped as the panic unwound.
            // One that runs too long is given up likewise.
            let timeout = self.config.hand_on_timeout;
            let caught = |ids| {
                let started = std::panic::catch_unwind(AssertUnwindSafe(|| (*hand_on)(ids)));
                async move {
                    let finished = match started {
                        Ok(handing_on) => {
                            let handing_on = AssertUnwindSafe(handing_on).catch_unwind();
                            match tokio::time::timeout(timeout, handing_on).await {
                                Ok(finished) => finished,
                                Err(_) => return Err(HandOnFailed::TimedOut(timeout)),
                            }
                        }
                        Err(payload) => Err(payload),
                    };
                    match finished {
                        Ok(out) => out.map_err(HandOnFailed::Refused),
                        Err(payload) => Err(HandOnFailed::Panicked(crate::service::panic_message(
                            &*payload,
                        ))),
                    }
                }
            };
            // A hand-on that failed is a failed pass, counted and logged
            // as the loop's others are: while its peer is down, a line a
            // minute, not one per pass.
            self.pass(caught).await
        })
        .await;
    }

    /// A pass, each batch's ids handed to `hand_on` before the batch
    /// commits. A batch that fails after others committed ends the pass
    /// with what they made pending (logged); the first batch's failure is
    /// the pass's.
    async fn pass<E, Fut>(
        &self,
        mut hand_on: impl FnMut(Vec<i64>) -> Fut,
    ) -> std::result::Result<RedriveCounts, BatchFailed<E>>
    where
        E: std::fmt::Display,
        Fut: Future<Output = std::result::Result<(), E>>,
    {
        let mut counts = RedriveCounts::default();
        loop {
            let batch = crate::transaction::read_committed(&self.pool, async |conn| {
                let ids: Vec<i64> = sqlx::query_scalar(include_str!("sql/redrive.sql"))
                    .bind(self.config.batch_size)
                    .fetch_all(conn)
                    .await?;
                if !ids.is_empty() {
                    hand_on(ids.clone()).await.map_err(BatchFailed::HandOn)?;
                }
                Ok(ids)
            })
            .await;
            let ids: Vec<i64> = match batch {
                Ok(ids) => ids,
                Err(e) if counts.redriven > 0 => {
                    tracing::warn!(redriven = counts.redriven, error = %e,
                        "re-drive pass cut short: returning the jobs it made pending");
                    break;
                }
                Err(e) => return Err(e),
            };
            let n = ids.len();
            counts.redriven += n as u64;
            counts.ids.extend(ids);
            if (n as i64) < self.config.batch_size {
                break;
            }
        }
        if counts.redriven > 0 {
            tracing::info!(redriven = counts.redriven, "failed jobs re-driven");
        }
        metrics::counter!("pgonce_job_redriven_total").increment(counts.redriven);
        Ok(counts)
    }
}

/// Why [`Redriver::run_handing_on`]'s hand-on did not take a batch's ids.
enum HandOnFailed<E> {
    /// It returned an error.
    Refused(E),
    /// It panicked, with this message.
    Panicked(String),
    /// It ran past the hand-on timeout, this one, and was given up.
    TimedOut(Duration),
}

impl<E: std::fmt::Display> std::fmt::Display for HandOnFailed<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandOnFailed::Refused(e) => e.fmt(f),
            HandOnFailed::Panicked(what) => write!(f, "it panicked: {what}"),
            HandOnFailed::TimedOut(after) => write!(f, "it ran past its timeout ({after:?})"),
        }
    }
}

/// Why a batch of a pass did not commit; its transaction rolled back.
enum BatchFailed<E> {
    /// Its statement or its commit failed.
    Database(crate::Error),
    /// The hand-on refused its ids.
    HandOn(E),
}

impl<E> From<sqlx::Error> for BatchFailed<E> {
    fn from(e: sqlx::Error) -> Self {
        BatchFailed::Database(e.into())
    }
}

impl<E: std::fmt::Display> std::fmt::Display for BatchFailed<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BatchFailed::Database(e) => e.fmt(f),
            BatchFailed::HandOn(e) => write!(
                f,
                "ids not handed on (their batch rolled back, the next pass hands them on): {e}"
            ),
        }
    }
}
