//! The reaper: returns jobs whose lease expired (their worker crashed, hung,
//! or lost its connection) to `pending`, or to `dead` past `max_attempts`.
//! Without it a claimed-then-crashed job would stay `processing` forever.

use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;

use crate::error::Result;

/// Settings of the [`Reaper`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaperConfig {
    /// Pause between passes of [`Reaper::run`]. Default 1 s; non-zero.
    pub interval: Duration,
    /// Jobs reaped per statement (one keyset batch). Default 1000; at least 1.
    pub batch_size: i64,
}

impl Default for ReaperConfig {
    fn default() -> Self {
        ReaperConfig {
            interval: Duration::from_secs(1),
            batch_size: 1000,
        }
    }
}

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReapCounts {
    /// Expired leases returned to `pending`.
    pub returned: u64,
    /// Jobs whose lease expired on their last attempt, now `dead`.
    pub dead: u64,
}

/// Returns expired leases; see the module docs.
#[derive(Debug, Clone)]
pub struct Reaper {
    pool: PgPool,
    config: ReaperConfig,
}

/// A job whose lease `sql/reap.sql` found expired, with where it went
/// (`pending`, or `dead` on its last attempt).
#[derive(sqlx::FromRow)]
struct Reaped {
    id: i64,
    status: String,
}

impl Reaper {
    /// Validates `config`.
    pub fn new(pool: PgPool, config: ReaperConfig) -> Result<Reaper> {
        crate::service::check_config("reaper config", config.interval, config.batch_size)?;
        Ok(Reaper { pool, config })
    }

    /// One pass: reaps every lease expired by now, batch by batch.
    pub async fn run_once(&self) -> Result<ReapCounts> {
        let mut counts = ReapCounts::default();
        loop {
            let rows: Vec<Reaped> = crate::transaction::read_committed(&self.pool, async |conn| {
                sqlx::query_as(include_str!("sql/reap.sql"))
                    .bind(self.config.batch_size)
                    .fetch_all(conn)
                    .await
            })
            .await?;
            for Reaped { id, status } in &rows {
                if status == "dead" {
                    counts.dead += 1;
                    tracing::warn!(job_id = id, "lease expired on the last attempt: job dead");
                } else {
                    counts.returned += 1;
                    tracing::warn!(job_id = id, "lease expired: job back to pending");
                }
            }
            if (rows.len() as i64) < self.config.batch_size {
                break;
            }
        }
        metrics::counter!("pgonce_job_reaped_total").increment(counts.returned);
        metrics::counter!("pgonce_job_dead_total").increment(counts.dead);
        Ok(counts)
    }

    /// Runs a pass every `interval` until `shutdown` completes. A failed pass
    /// is counted and logged (the first, then a line a minute at most, then
    /// the recovery: [`crate::service`]) and the next one tried.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        crate::service::run_every("reaper", self.config.interval, shutdown, || self.run_once())
            .await;
    }
}
