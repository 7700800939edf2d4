//! The re-driver: the DB-driven retry loop. Failed jobs whose backoff has
//! passed (`run_at <= now()`) become `pending` again. The row, not the queue,
//! is the retry ledger: with [`crate::queue::AckPolicy::AlwaysDelete`] the message
//! of a failed job is gone, and the ids this returns are what a queue worker
//! re-publishes. A delivery of a failed job's kept message may claim it
//! first, once due ([`crate::job::claim`] takes a due failed job); the
//! re-driver then passes it over.

use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;

use crate::error::Result;

/// Settings of the [`Redriver`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedriverConfig {
    /// Pause between passes of [`Redriver::run`]. Default 1 s; non-zero.
    pub interval: Duration,
    /// Jobs re-driven per statement. Default 1000; at least 1.
    pub batch_size: i64,
}

impl Default for RedriverConfig {
    fn default() -> Self {
        RedriverConfig {
            interval: Duration::from_secs(1),
            batch_size: 1000,
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
        Ok(Redriver { pool, config })
    }

    /// One pass: every failed job due by now becomes pending, batch by
    /// batch, each batch committed on its own. A batch that fails after
    /// others committed ends the pass with what they made pending (the
    /// failure is logged): those jobs are pending already, and their ids
    /// are the only record of which to re-publish. The next pass takes the
    /// rest. A pass whose first batch fails returns the error.
    pub async fn run_once(&self) -> Result<RedriveCounts> {
        let mut counts = RedriveCounts::default();
        loop {
            let batch = crate::transaction::read_committed(&self.pool, async |conn| {
                sqlx::query_scalar(include_str!("sql/redrive.sql"))
                    .bind(self.config.batch_size)
                    .fetch_all(conn)
                    .await
            })
            .await;
            let ids: Vec<i64> = match batch {
                Ok(ids) => ids,
                Err(e) if counts.redriven > 0 => {
                    tracing::warn!(redriven = counts.redriven, error = %e,
                        "re-drive pass cut short: returning the jobs it made pending");
                    break;
                }
                Err(e) => return Err(e.into()),
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

    /// Runs a pass every `interval` until `shutdown` completes.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        crate::service::run_every("redriver", self.config.interval, shutdown, || {
            self.run_once()
        })
        .await;
    }
}
