//! `pgonce bench jobs`: N workers claim and complete jobs.
//!
//! Two parts, on one database, in one run:
//!
//! * **throughput**: workers pull prefilled jobs and complete them: pgonce's
//!   two-phase claim (one job per claim, and 16 per claim with `FOR UPDATE
//!   SKIP LOCKED`, completed one by one or with `complete_many`, one
//!   statement and one commit for the batch) and sqlxmq, a job queue from crates.io, doing the same
//!   work (bump an in-memory side-effect counter, then complete). Figures:
//!   jobs/s, p50/p99 claim-to-complete. `pgonce_vs_best_peer` is the best
//!   pgonce rate over the best peer's.
//! * **forced redelivery**: every job's message is delivered twice, the two
//!   deliveries back to back on different workers, under no-guard,
//!   where-status, two-phase and dedupe-key. Figure: `duplicate_side_effects`
//!   (side effects beyond one per job), and jobs/s. Under two-phase a
//!   delivery that finds the job claimed but not done gets `JobBusy` and
//!   keeps its message, which is delivered again until the job is done
//!   (`busy_redelivered` counts those extra deliveries).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pgonce::Error;
use pgonce::IsolationLevel;
use pgonce::job::{self, JobStatus};
use serde_json::json;
use sqlx::PgPool;

use super::BenchArgs;
use super::measure::{Measured, closed_loop, new_histogram, round2};
use super::peers;
use crate::report::{Report, Row};
use crate::scratch::RunDatabase;

const LEASE: Duration = Duration::from_secs(300);

pub(crate) async fn run(
    args: &BenchArgs,
    db: &RunDatabase,
    database_url: Option<&str>,
) -> anyhow::Result<Report> {
    let workers = if args.quick { 4 } else { 8 };
    let phase = args.phase();
    let mut report = Report::new("bench", "jobs", db.environment().await?);

    // Throughput: pgonce.
    let mut best_pgonce: f64 = 0.0;
    let mut pgonce_rates = Vec::new();
    for (strategy, batch, bulk) in [
        ("pgonce-two-phase", 1i64, false),
        ("pgonce-two-phase-batch16", 16, false),
        ("pgonce-two-phase-batch16-complete-many", 16, true),
    ] {
        let kind = strategy.to_string();
        prefill(db.pool(), &kind, if args.quick { 10_000 } else { 60_000 }).await?;
        let effects = Arc::new(AtomicU64::new(0));
        let jobs_done = Arc::new(AtomicU64::new(0));
        let (pool, e, d) = (db.pool().clone(), effects.clone(), jobs_done.clone());
        let m = closed_loop(strategy, workers, phase, move |_, _| {
            let (pool, kind, e, d) = (pool.clone(), kind.clone(), e.clone(), d.clone());
            async move {
                let claimed = job::claim_batch(&pool, &kind, batch, LEASE).await?;
                if claimed.is_empty() {
                    return Ok(Some("empty_polls"));
                }
                if bulk {
                    let mut done = Vec::with_capacity(claimed.len());
                    for c in claimed {
                        e.fetch_add(1, Ordering::Relaxed);
                        done.push((c.lease, json!(null)));
                    }
                    let lost = job::complete_many(&pool, &done).await?;
                    anyhow::ensure!(lost.is_empty(), "leases lost: {lost:?}");
                    d.fetch_add(done.len() as u64, Ordering::Relaxed);
                    return Ok(None);
                }
                for c in claimed {
                    e.fetch_add(1, Ordering::Relaxed);
                    job::complete(&pool, &c.lease, &json!(null)).await?;
                    d.fetch_add(1, Ordering::Relaxed);
                }
                Ok(None)
            }
        })
        .await;
        let rate = jobs_done.load(Ordering::Relaxed) as f64 / m.elapsed.as_secs_f64();
        best_pgonce = best_pgonce.max(rate);
        pgonce_rates.push((strategy, rate));
        report
            .results
            .push(throughput_row(strategy, &m, rate, workers, batch));
        check_errors(&mut report, strategy, &m);
    }

    // Throughput: sqlxmq on the same database.
    let peer_options = peers::sqlxmq::connect_options(database_url, &db.options())?;
    peers::sqlxmq::install(&peer_options).await?;
    // Two settings: at most `workers` jobs in flight like pgonce's workers,
    // and sqlxmq's own defaults (16 to 32 in flight); the best one counts.
    let peer_jobs = if args.quick { 5_000 } else { 30_000 };
    let mut peer_rate: f64 = 0.0;
    for (strategy, min, max) in [
        ("sqlxmq-0.6", workers.div_ceil(2), workers),
        ("sqlxmq-0.6-defaults", 16, 32),
    ] {
        let effects = Arc::new(AtomicU64::new(0));
        let bump = Arc::new(move || {
            effects.fetch_add(1, Ordering::Relaxed);
        });
        let m = peers::sqlxmq::run(&peer_options, (min, max), peer_jobs, phase, bump).await?;
        peer_rate = peer_rate.max(m.ops_per_sec());
        report.results.push(
            throughput_row(strategy, &m, m.ops_per_sec(), max, 0).with("prefilled", peer_jobs),
        );
        judge_peer(&mut report, strategy, &m, peer_jobs);
    }
    report.ratio("pgonce_vs_best_peer", best_pgonce, peer_rate);
    // Each variant on its own, so the headline ratio hides nothing.
    for (strategy, rate) in &pgonce_rates {
        report.ratio(&format!("{strategy}_vs_best_peer"), *rate, peer_rate);
    }

    // Forced redelivery.
    let jobs_per_variant = if args.quick { 400 } else { 3_000 };
    for strategy in [
        Guard::Unguarded,
        Guard::WhereStatus,
        Guard::TwoPhase,
        Guard::DedupeKey,
    ] {
        let name = strategy.name();
        let Prefilled { first, last } = prefill(db.pool(), name, jobs_per_variant).await?;
        let r = redeliver(db.pool(), strategy, workers, first, last).await?;
        let dup = r.duplicates;
        report.results.push(
            r.measured
                .row(name)
                .with(
                    "jobs_per_sec",
                    round2(r.jobs as f64 / r.measured.elapsed.as_secs_f64()),
                )
                .with("deliveries", r.jobs * 2)
                .with("duplicate_side_effects", dup)
                .with("workers", workers)
                .with("invariant_held", dup == 0),
        );
        match strategy {
            Guard::Unguarded | Guard::WhereStatus => report.verdict.check(
                true,
                format!("{name}: {dup} duplicate side effects under forced redelivery (shown)"),
            ),
            Guard::TwoPhase | Guard::DedupeKey => report.verdict.check(
                dup == 0 && r.measured.errors == 0,
                format!(
                    "{name}: {dup} duplicate side effects, {} errors under forced redelivery",
                    r.measured.errors
                ),
            ),
        }
    }
    report.ratio_goal("pgonce_vs_best_peer", 1.2).note = Some(format!(
        "best pgonce guard {} jobs/s against the best peer's {} jobs/s",
        round2(best_pgonce),
        round2(peer_rate)
    ));
    Ok(report)
}

fn throughput_row(strategy: &str, m: &Measured, rate: f64, workers: usize, batch: i64) -> Row {
    let mut row = Row::new(strategy)
        .with("jobs_per_sec", round2(rate))
        .with("claim_to_complete_p50_ms", round2(m.quantile_ms(0.5)))
        .with("claim_to_complete_p99_ms", round2(m.quantile_ms(0.99)))
        .with("max_ms", round2(m.max_ms()))
        .with("errors", m.errors)
        .with("workers", workers);
    if batch > 0 {
        row.set("claim_batch", batch);
    }
    for (k, v) in &m.counters {
        row.set(k, v);
    }
    row
}

/// The verdict's line for a peer's throughput run over `prefilled` jobs:
/// no errors. How many jobs it got through in the phase is a figure (its
/// row's `jobs_per_sec`), never part of the verdict: all of them on a fast
/// machine (the run then ends early, its rate still the rate), none on a
/// busy one.
fn judge_peer(report: &mut Report, strategy: &str, m: &Measured, prefilled: u64) {
    report.verdict.check(
        m.errors == 0,
        format!(
            "{strategy}: {} errors{}; {} of {prefilled} prefilled jobs completed in the phase",
            m.errors,
            m.first_error
                .as_ref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default(),
            m.ops
        ),
    );
}

fn check_errors(report: &mut Report, strategy: &str, m: &Measured) {
    report.verdict.check(
        m.errors == 0,
        format!(
            "{strategy}: {} errors{}",
            m.errors,
            m.first_error
                .as_ref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        ),
    );
}

/// The ids of the jobs [`prefill`] inserted: `first..=last`, empty when
/// none was (`first` 0, `last` -1).
struct Prefilled {
    first: i64,
    last: i64,
}

async fn prefill(pool: &PgPool, kind: &str, n: i64) -> anyhow::Result<Prefilled> {
    /// The first and last id `sql/jobs_prefill.sql` inserted, if any.
    #[derive(sqlx::FromRow)]
    struct PrefillRow {
        first: Option<i64>,
        last: Option<i64>,
    }
    let PrefillRow { first, last } = sqlx::query_as(include_str!("sql/jobs_prefill.sql"))
        .bind(kind)
        .bind(n)
        .fetch_one(pool)
        .await?;
    Ok(Prefilled {
        first: first.unwrap_or(0),
        last: last.unwrap_or(-1),
    })
}

#[derive(Debug, Clone, Copy)]
enum Guard {
    Unguarded,
    WhereStatus,
    TwoPhase,
    DedupeKey,
}

impl Guard {
    fn name(self) -> &'static str {
        match self {
            Guard::Unguarded => "redelivery-no-guard",
            Guard::WhereStatus => "redelivery-where-status",
            Guard::TwoPhase => "redelivery-two-phase",
            Guard::DedupeKey => "redelivery-dedupe-key",
        }
    }
}

struct Redelivered {
    measured: Measured,
    jobs: u64,
    duplicates: u64,
}

/// Delivers each job in `first..=last` twice, the two deliveries back to back
/// so two workers handle them at once; counts side effects per job.
async fn redeliver(
    pool: &PgPool,
    guard: Guard,
    workers: usize,
    first: i64,
    last: i64,
) -> anyhow::Result<Redelivered> {
    let n = (last - first + 1).max(0) as usize;
    let effects: Arc<Vec<AtomicU32>> = Arc::new((0..n).map(|_| AtomicU32::new(0)).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (pool, effects, next) = (pool.clone(), effects.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut latency = new_histogram();
            let (mut ops, mut errors, mut first_error) = (0u64, 0u64, None);
            let (mut handled, mut busy) = (0u64, 0u64);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= 2 * n {
                    break;
                }
                let slot = i / 2;
                let id = first + slot as i64;
                let t = Instant::now();
                // A delivery that finds the job busy keeps its message: it
                // comes back (here at once) until the job is done.
                let mut delivered = deliver(&pool, guard, id, &effects[slot]).await;
                while let Ok(Delivery::Busy) = delivered {
                    busy += 1;
                    tokio::task::yield_now().await;
                    delivered = deliver(&pool, guard, id, &effects[slot]).await;
                }
                match delivered {
                    Ok(d) => {
                        ops += 1;
                        handled += (d == Delivery::AlreadyHandled) as u64;
                        let _ = latency.record(t.elapsed().as_micros().max(1) as u64);
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| format!("{e:#}"));
                    }
                }
            }
            (latency, ops, errors, first_error, handled, busy)
        }));
    }
    let mut measured = Measured {
        ops: 0,
        errors: 0,
        first_error: None,
        elapsed: Duration::ZERO,
        latency: new_histogram(),
        counters: Default::default(),
    };
    let (mut handled, mut busy) = (0, 0);
    for t in tasks {
        let (latency, ops, errors, first_error, h, b) = t.await?;
        measured.latency.add(&latency).expect("same bounds");
        measured.ops += ops;
        measured.errors += errors;
        handled += h;
        busy += b;
        if measured.first_error.is_none() {
            measured.first_error = first_error;
        }
    }
    measured.elapsed = started.elapsed();
    measured.counters.insert("already_handled", handled);
    measured.counters.insert("busy_redelivered", busy);
    let duplicates = effects
        .iter()
        .map(|c| c.load(Ordering::Relaxed).saturating_sub(1) as u64)
        .sum();
    Ok(Redelivered {
        measured,
        jobs: n as u64,
        duplicates,
    })
}

/// What one delivery did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    /// Ran the side effect and the transition.
    Applied,
    /// Found the job done: the message is acknowledged.
    AlreadyHandled,
    /// Found the job claimed by the other delivery, not done: the message
    /// is kept and delivered again.
    Busy,
}

/// One delivery of job `id`.
async fn deliver(
    pool: &PgPool,
    guard: Guard,
    id: i64,
    effect: &AtomicU32,
) -> anyhow::Result<Delivery> {
    let done = json!({"done": true});
    match guard {
        Guard::Unguarded => {
            effect.fetch_add(1, Ordering::Relaxed);
            sqlx::query(
                "UPDATE pgonce.jobs SET status = 'completed', result = $2, finished_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(&done)
            .execute(pool)
            .await?;
            Ok(Delivery::Applied)
        }
        Guard::WhereStatus => {
            effect.fetch_add(1, Ordering::Relaxed);
            match job::transition(
                pool,
                id,
                JobStatus::Pending,
                JobStatus::Completed,
                Some(&done),
                None,
            )
            .await
            {
                Ok(()) => Ok(Delivery::Applied),
                Err(Error::AlreadyHandled { .. }) => Ok(Delivery::AlreadyHandled),
                Err(e) => Err(e.into()),
            }
        }
        Guard::TwoPhase => match job::claim(pool, id, LEASE).await {
            Ok(lease) => {
                effect.fetch_add(1, Ordering::Relaxed);
                job::complete(pool, &lease, &done).await?;
                Ok(Delivery::Applied)
            }
            Err(Error::AlreadyHandled { .. }) => Ok(Delivery::AlreadyHandled),
            Err(Error::JobBusy { .. }) => Ok(Delivery::Busy),
            Err(e) => Err(e.into()),
        },
        Guard::DedupeKey => {
            let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
            if !pgonce::dedupe::mark_processed(&mut tx, "bench-jobs", &id.to_string()).await? {
                tx.rollback().await?;
                return Ok(Delivery::AlreadyHandled);
            }
            job::transition(
                &mut *tx,
                id,
                JobStatus::Pending,
                JobStatus::Completed,
                Some(&done),
                None,
            )
            .await?;
            tx.commit().await?;
            // The effect runs once the key is durably recorded.
            effect.fetch_add(1, Ordering::Relaxed);
            Ok(Delivery::Applied)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Environment;

    fn measured(ops: u64) -> Measured {
        Measured {
            ops,
            errors: 0,
            first_error: None,
            elapsed: Duration::from_secs(2),
            latency: new_histogram(),
            counters: Default::default(),
        }
    }

    /// A peer that got through all of its prefilled jobs in the phase (a
    /// fast machine), or none of them (a busy one), did nothing wrong.
    #[test]
    fn how_far_a_peer_got_never_fails_the_verdict() {
        for ops in [0, 1, 4_999, 5_000] {
            let mut report = Report::new("bench", "jobs", Environment::unknown());
            judge_peer(&mut report, "sqlxmq-0.6", &measured(ops), 5_000);
            assert!(report.verdict.ok, "{ops}: {:?}", report.verdict);
        }
        let mut report = Report::new("bench", "jobs", Environment::unknown());
        let mut failed = measured(10);
        failed.errors = 1;
        judge_peer(&mut report, "sqlxmq-0.6", &failed, 5_000);
        assert!(!report.verdict.ok, "an error still fails it");
    }
}
