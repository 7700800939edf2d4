//! sqlxmq 0.6 (on sqlx 0.8) as a peer: M jobs are inserted in one
//! statement, a `JobRunner` with `workers` concurrent jobs drains them, and
//! each handler runs the same side effect as pgonce's workers, then
//! `complete()`s the job (sqlxmq deletes it).
//!
//! Latency is handler start to `complete()` returned: sqlxmq claims inside
//! its runner (`mq_poll`), where a handler cannot see it, so its figure
//! leaves the claim out while pgonce's includes it.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use sqlx08::postgres::{PgConnectOptions, PgPoolOptions};

use crate::bench::measure::{Measured, new_histogram};

const MIGRATIONS: [&str; 5] = [
    include_str!("sqlxmq/20210316025847_setup.up.sql"),
    include_str!("sqlxmq/20210921115907_clear.up.sql"),
    include_str!("sqlxmq/20211013151757_fix_mq_latest_message.up.sql"),
    include_str!("sqlxmq/20220208120856_fix_concurrent_poll.up.sql"),
    include_str!("sqlxmq/20220713122907_fix-clear_all-keep-nil-message.up.sql"),
];

const PREFILL: &str = "SELECT mq_insert(ARRAY(
    SELECT ROW(uuid_generate_v4(), interval '0', 0, interval '1 second', 'bench', '',
               NULL::interval, false, 'bench_job', '{}', NULL::bytea)::mq_new_t
    FROM generate_series(1, $1)))";

/// Connection options for sqlx 0.8 to the database `options` names.
pub(crate) fn connect_options(
    database_url: Option<&str>,
    options: &sqlx::postgres::PgConnectOptions,
) -> anyhow::Result<PgConnectOptions> {
    let base = match database_url {
        Some(url) => PgConnectOptions::from_str(url)?,
        None => PgConnectOptions::new()
            .host(options.get_host())
            .port(options.get_port())
            .username(options.get_username()),
    };
    Ok(base.database(options.get_database().unwrap_or("postgres")))
}

/// Applies sqlxmq's migrations (once per database).
pub(crate) async fn install(options: &PgConnectOptions) -> anyhow::Result<()> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await?;
    for sql in MIGRATIONS {
        sqlx08::raw_sql(sql).execute(&pool).await?;
    }
    pool.close().await;
    Ok(())
}

/// Drains `jobs` prefilled jobs with up to `max_concurrency` handlers for at
/// most `duration`; `effect` is called once per handled job.
pub(crate) async fn run(
    options: &PgConnectOptions,
    (min_concurrency, max_concurrency): (usize, usize),
    jobs: u64,
    duration: Duration,
    effect: Arc<dyn Fn() + Send + Sync>,
) -> anyhow::Result<Measured> {
    let pool = PgPoolOptions::new()
        .max_connections(max_concurrency as u32 + 4)
        .connect_with(options.clone())
        .await?;
    sqlx08::query("SELECT mq_clear_all()")
        .execute(&pool)
        .await?;
    sqlx08::query(PREFILL)
        .bind(jobs as i32)
        .execute(&pool)
        .await?;
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let latency = Arc::new(std::sync::Mutex::new(new_histogram()));
    let started = Instant::now();
    let runner = {
        let (done, errors, latency) = (done.clone(), errors.clone(), latency.clone());
        sqlxmq::JobRunnerOptions::new(&pool, move |mut job| {
            let (done, errors, latency, effect) = (
                done.clone(),
                errors.clone(),
                latency.clone(),
                effect.clone(),
            );
            tokio::spawn(async move {
                let t = Instant::now();
                effect();
                match job.complete().await {
                    Ok(()) => {
                        let us = t.elapsed().as_micros().max(1) as u64;
                        let _ = latency.lock().expect("histogram").record(us);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        })
        .set_concurrency(min_concurrency, max_concurrency)
        .set_keep_alive(false)
        .set_channel_names(&["bench"])
        .run()
        .await?
    };
    let deadline = started + duration;
    while Instant::now() < deadline && done.load(Ordering::Relaxed) < jobs {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    drop(runner);
    pool.close().await;
    let latency: Histogram<u64> = latency.lock().expect("histogram").clone();
    Ok(Measured {
        ops: done.load(Ordering::Relaxed),
        errors: errors.load(Ordering::Relaxed),
        first_error: None,
        elapsed,
        latency,
        counters: Default::default(),
    })
}
