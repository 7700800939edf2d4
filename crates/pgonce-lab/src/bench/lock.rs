//! `pgonce bench lock`: what a transaction-level advisory lock adds to a
//! short write transaction (BEGIN, INSERT, COMMIT with fsync on), with a key
//! per worker and with one key shared by all workers.

use pgonce::IsolationLevel;
use sqlx::PgPool;

use super::BenchArgs;
use super::measure::closed_loop;
use crate::report::Report;
use crate::scratch::RunDatabase;

#[derive(Clone, Copy)]
enum Keys {
    None,
    PerWorker,
    Shared,
}

pub(crate) async fn run(args: &BenchArgs, db: &RunDatabase) -> anyhow::Result<Report> {
    let workers = if args.quick { 4 } else { 16 };
    sqlx::raw_sql(include_str!("sql/lock_schema.sql"))
        .execute(db.pool())
        .await?;
    let mut report = Report::new("bench", "lock", db.environment().await?);
    let mut rate = Vec::new();
    for (strategy, keys) in [
        ("no-lock", Keys::None),
        ("xact-lock-per-worker", Keys::PerWorker),
        ("xact-lock-one-key", Keys::Shared),
    ] {
        let pool = db.pool().clone();
        let m = closed_loop(strategy, workers, args.phase(), move |worker, _| {
            let pool = pool.clone();
            async move { write(&pool, worker, keys).await }
        })
        .await;
        rate.push(m.ops_per_sec());
        report
            .results
            .push(m.row(strategy).with("workers", workers));
        report.verdict.check(
            m.errors == 0,
            format!(
                "{strategy}: {} errors{}",
                m.errors,
                m.first_error
                    .map(|e| format!(" (first: {e})"))
                    .unwrap_or_default()
            ),
        );
    }
    report.ratio("per_worker_vs_no_lock", rate[1], rate[0]);
    report.ratio("one_key_vs_no_lock", rate[2], rate[0]);
    Ok(report)
}

async fn write(pool: &PgPool, worker: usize, keys: Keys) -> anyhow::Result<Option<&'static str>> {
    let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
    let key = match keys {
        Keys::None => None,
        Keys::PerWorker => Some(worker as i64),
        Keys::Shared => Some(0),
    };
    if let Some(key) = key {
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(key)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query("INSERT INTO bench_lock_rows (worker) VALUES ($1)")
        .bind(worker as i32)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(None)
}
