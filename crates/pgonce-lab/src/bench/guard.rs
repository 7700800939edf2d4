//! `pgonce bench guard`: the incident pipeline's worker (read, evaluate for L
//! with no transaction, then create or resolve an incident) under each
//! strategy, in three scenarios:
//!
//! * low contention (W=16, E=10,000): guard vs two-transactions, the same
//!   shape without lock and re-read; goal at least 0.95. Measured twice: with
//!   the evaluation a remote call of L=50 ms (a real evaluation's shape, and
//!   the pool-pressure scenario's L: the goal's figure), and with L=5 ms,
//!   where 16 workers keep both cores busy and the ratio shows what the
//!   guard's extra round trip costs in CPU (5 messages per decision against
//!   4). The 5 ms run also has `guard-begin-check`, the guard with BEGIN and
//!   lock in separate round trips (which `Guard::write` sends in one);
//! * hot entity (E = 1 to 4): guard vs serializable (read, evaluation and
//!   write in one SERIALIZABLE transaction, retried on abort);
//! * pool pressure (P=10, 100 in flight, L=50 ms): guard vs a session-level
//!   lock held across the evaluation; goal at least 8x.
//!
//! The rows and writes are [`crate::scenario::guard`]'s. A decision reads
//! the entity's OPEN incidents and resolves what is open, or else opens
//! one ([`Decision::toggle`]), so every decision writes. Violations of I1
//! are counted afterwards over the whole history: incidents of one entity
//! OPEN at the same moment ([`scenario::overlaps`]).
//!
//! The session lock needs the client's server session to last from one
//! transaction to the next. Behind a transaction-mode pooler it does not:
//! the lock would stay with a server connection that then serves other
//! clients, and every later taker of that entity's lock would wait
//! forever. So the bench first asks whether sessions survive
//! ([`sessions_survive`]) and, if not, skips the pool-pressure scenario
//! and says why in the report (and its JSON).
//!
//! `--repeat N` runs every group N times, rotating the order, and reports
//! each ratio as the median of the runs (every run's value in a section).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pgonce::IsolationLevel;
use pgonce::{Error, Guard, GuardConfig};
use rand::Rng;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::BenchArgs;
use super::measure::{Outcome, closed_loop, median, new_histogram, round2, runs_row};
use crate::behind_pooler::sessions_survive;
use crate::report::{Report, Row};
use crate::scenario::guard::{
    self as scenario, Decision, Entity, GuardStrategy as Strategy, Written,
};
use crate::scratch::RunDatabase;

#[derive(Debug, Clone, Copy)]
struct Shape {
    workers: usize,
    entities: i32,
    eval: Duration,
    pool: u32,
}

/// Figures a decision adds to besides the closed loop's.
#[derive(Default)]
struct Extra {
    incidents: AtomicU64,
    aborts: AtomicU64,
    write_tx: Mutex<Option<Histogram<u64>>>,
    lock_hold: Mutex<Option<Histogram<u64>>>,
}

impl Extra {
    fn new() -> Extra {
        Extra {
            write_tx: Mutex::new(Some(new_histogram())),
            lock_hold: Mutex::new(Some(new_histogram())),
            ..Extra::default()
        }
    }

    fn record(slot: &Mutex<Option<Histogram<u64>>>, since: Instant) {
        if let Some(h) = slot.lock().expect("histogram lock").as_mut() {
            let _ = h.record(since.elapsed().as_micros().max(1) as u64);
        }
    }

    fn quantile_ms(slot: &Mutex<Option<Histogram<u64>>>, q: f64) -> f64 {
        slot.lock()
            .expect("histogram lock")
            .as_ref()
            .filter(|h| !h.is_empty())
            .map_or(0.0, |h| round2(h.value_at_quantile(q) as f64 / 1000.0))
    }
}

pub(crate) async fn run(args: &BenchArgs, db: &RunDatabase) -> anyhow::Result<Report> {
    scenario::create_schema(db.pool()).await?;
    let mut report = Report::new("bench", "guard", db.environment().await?);
    let phase = args.phase();
    let eval_short = Duration::from_millis(5);
    let low = Shape {
        workers: 16,
        entities: 10_000,
        eval: Duration::from_millis(50),
        pool: 32,
    };
    let low_saturated = Shape {
        eval: eval_short,
        ..low
    };
    let pressure = Shape {
        workers: 100,
        entities: 10_000,
        eval: Duration::from_millis(50),
        pool: 10,
    };
    let hot_es: &[i32] = if args.quick { &[1, 4] } else { &[1, 2, 4] };
    let session_lock_skipped = match sessions_survive(db.pool()).await? {
        true => None,
        false => Some(SESSION_LOCK_SKIPPED),
    };

    // Every ratio compares strategies measured one after the other, so a
    // change in the machine's load between them skews it. With --repeat the
    // groups run again, in a rotated order each run, and each ratio is the
    // median of the runs.
    let runs = args.repeat.max(1);
    let mut ratios: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for run in 1..=runs {
        let mut group = async |scenario: &str, strategies: &[Strategy], shape: Shape| {
            let n = strategies.len();
            let mut rates = vec![0.0; n];
            for i in 0..n {
                let k = (i + run as usize - 1) % n;
                rates[k] =
                    measure(db, &mut report, scenario, strategies[k], shape, phase, run).await?;
            }
            anyhow::Ok(rates)
        };
        let mut found = Vec::new();
        // Low contention: the guard against the same write unguarded, with
        // a slow remote evaluation (the goal's figure)...
        let low_rates = group(
            "low-contention",
            &[Strategy::Guard, Strategy::TwoTransactions],
            low,
        )
        .await?;
        found.push((
            "low_contention_guard_vs_two_transactions".to_string(),
            low_rates[0] / low_rates[1].max(1e-9),
        ));
        // ...and with a 5 ms one, CPU-bound on this machine, also against
        // the first shape of the guard (one round trip more).
        let low_rates = group(
            "low-contention-l5",
            &[
                Strategy::Guard,
                Strategy::TwoTransactions,
                Strategy::GuardBeginCheck,
            ],
            low_saturated,
        )
        .await?;
        found.push((
            "low_contention_l5_guard_vs_two_transactions".to_string(),
            low_rates[0] / low_rates[1].max(1e-9),
        ));
        found.push((
            "low_contention_l5_guard_begin_check_vs_two_transactions".to_string(),
            low_rates[2] / low_rates[1].max(1e-9),
        ));
        // Hot entity.
        for &entities in hot_es {
            let hot = Shape {
                workers: 16,
                entities,
                eval: eval_short,
                pool: 32,
            };
            let scenario = format!("hot-entity-e{entities}");
            let r = group(&scenario, &[Strategy::Guard, Strategy::Serializable], hot).await?;
            found.push((
                format!("hot_e{entities}_guard_vs_serializable"),
                r[0] / r[1].max(1e-9),
            ));
        }
        // Pool pressure, where a session lock can be held.
        if session_lock_skipped.is_none() {
            let r = group(
                "pool-pressure",
                &[Strategy::Guard, Strategy::SessionLock],
                pressure,
            )
            .await?;
            found.push((
                "pool_pressure_guard_vs_session_lock".to_string(),
                r[0] / r[1].max(1e-9),
            ));
        }
        for (name, ratio) in found {
            ratios.entry(name).or_default().push(ratio);
        }
    }
    let mut per_run = Vec::new();
    for (name, values) in &ratios {
        report.ratio(name, median(values), 1.0);
        per_run.push(runs_row(name, values));
    }
    report.sections.insert(
        format!("ratios of each run ({runs} runs, order rotated each run)"),
        per_run,
    );

    report
        .ratio_goal("low_contention_guard_vs_two_transactions", 0.95)
        .note = Some("L = 50 ms".into());
    let pressure = report.ratio_goal("pool_pressure_guard_vs_session_lock", 8.0);
    if pressure.measured.is_none() {
        pressure.note = Some(SESSION_LOCK_SKIPPED.into());
    }
    if let Some(reason) = session_lock_skipped {
        report.sections.insert(
            "skipped".into(),
            vec![
                Row::new(Strategy::SessionLock.name())
                    .with("scenario", "pool-pressure")
                    .with("reason", reason),
            ],
        );
    }
    Ok(report)
}

/// The scope of the bench's rows (the table is emptied before each
/// measurement).
const SCOPE: &str = "bench-guard";

/// Why the session lock is not measured behind a transaction-mode pooler.
const SESSION_LOCK_SKIPPED: &str = "sessions do not survive from one transaction to the next \
     (a transaction-mode pooler is in between): a session-level lock would stay with a \
     server connection other clients then use, and its next takers would wait forever";

/// One strategy in one scenario: a closed loop on a pool of `shape.pool`,
/// then violations counted in the database. Returns decisions per second.
async fn measure(
    db: &RunDatabase,
    report: &mut Report,
    scenario: &str,
    strategy: Strategy,
    shape: Shape,
    phase: Duration,
    run: u32,
) -> anyhow::Result<f64> {
    scenario::reset(db.pool()).await?;
    // No ping per checkout (sqlx's test_before_acquire, on by default): a
    // round trip of pool upkeep, not of any strategy, that the guard would
    // pay twice per decision (read and write) and the session lock once. A
    // pool whose server is on other cores pays it in latency, not in this
    // machine's two cores, which the strategies share with the server.
    let pool = PgPoolOptions::new()
        .max_connections(shape.pool)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(db.options())
        .await?;
    let extra = Arc::new(Extra::new());
    let guard = Guard::new(format!("bench-{scenario}"), GuardConfig::default())?;
    let label = format!("{scenario} {}", strategy.name());
    let m = {
        let (pool, extra) = (pool.clone(), extra.clone());
        closed_loop(&label, shape.workers, phase, move |_, _| {
            let (pool, extra, guard) = (pool.clone(), extra.clone(), guard.clone());
            let entity = rand::rng().random_range(0..shape.entities);
            async move { decide(&pool, &guard, &extra, strategy, shape, entity).await }
        })
        .await
    };
    pool.close().await;
    let violations = scenario::overlaps(db.pool(), SCOPE).await?.len() as i64;
    let secs = m.elapsed.as_secs_f64().max(1e-9);
    let incidents = extra.incidents.load(Ordering::Relaxed);
    let aborts = extra.aborts.load(Ordering::Relaxed);
    let mut row = m
        .row(&format!("{scenario}: {}", strategy.name()))
        .with("run", run)
        .with("workers", shape.workers)
        .with("entities", shape.entities)
        .with("eval_ms", shape.eval.as_millis() as u64)
        .with("pool", shape.pool)
        .with("incidents_per_sec", round2(incidents as f64 / secs))
        .with("write_p50_ms", Extra::quantile_ms(&extra.write_tx, 0.5))
        .with("write_p99_ms", Extra::quantile_ms(&extra.write_tx, 0.99))
        .with(
            "lock_hold_p50_ms",
            Extra::quantile_ms(&extra.lock_hold, 0.5),
        )
        .with(
            "lock_hold_p99_ms",
            Extra::quantile_ms(&extra.lock_hold, 0.99),
        )
        .with("aborts", aborts)
        .with("violations", violations)
        .with("invariant_held", violations == 0);
    if !m.counters.contains_key("conflicts") {
        row.set("conflicts", 0);
    }
    report.results.push(row);
    report.verdict.check(
        m.errors == 0,
        format!(
            "{label}: {} errors{}",
            m.errors,
            m.first_error
                .as_ref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        ),
    );
    if strategy != Strategy::TwoTransactions {
        report.verdict.check(
            violations == 0,
            format!("{label}: {violations} violations counted in the database"),
        );
    }
    Ok(m.ops_per_sec())
}

/// Counts what a committed (or refused) write did.
fn tally(extra: &Extra, written: &Written) -> Outcome {
    match written {
        Written::Opened => {
            extra.incidents.fetch_add(1, Ordering::Relaxed);
            None
        }
        Written::Resolved => None,
        Written::Refused(_) => Some("conflicts"),
    }
}

async fn decide(
    pool: &PgPool,
    guard: &Guard,
    extra: &Extra,
    strategy: Strategy,
    shape: Shape,
    entity: i32,
) -> anyhow::Result<Outcome> {
    let entity = Entity::new(SCOPE, entity.to_string());
    let entity = &entity;
    match strategy {
        Strategy::TwoTransactions => {
            let seen = scenario::read_open(&mut *pool.acquire().await?, entity).await?;
            tokio::time::sleep(shape.eval).await;
            let t = Instant::now();
            let written = scenario::write_plain(pool, entity, Decision::toggle(&seen), 0).await?;
            Extra::record(&extra.write_tx, t);
            Ok(tally(extra, &written))
        }
        Strategy::Guard => {
            let seen = scenario::read_guarded(guard, pool, entity).await?;
            tokio::time::sleep(shape.eval).await;
            let t = Instant::now();
            let decision = Decision::toggle(&seen);
            let guarded = scenario::write_guarded(guard, pool, entity, &seen, decision, 0).await?;
            Extra::record(&extra.write_tx, t);
            if let Some(locked_at) = guarded.locked_at {
                Extra::record(&extra.lock_hold, locked_at);
            }
            Ok(tally(extra, &guarded.written))
        }
        Strategy::GuardBeginCheck => {
            let seen = scenario::read_guarded(guard, pool, entity).await?;
            tokio::time::sleep(shape.eval).await;
            let key = entity.lock_key()?;
            let t = Instant::now();
            let mut granted = None;
            let mut tx = guard.begin(pool).await?;
            let checked = tx
                .check(key, &seen, async |c| {
                    granted = Some(Instant::now());
                    scenario::read_open(c, entity).await
                })
                .await;
            let outcome = match checked {
                Ok(()) => {
                    let written =
                        scenario::apply(&mut tx, entity, Decision::toggle(&seen), 0).await?;
                    tx.commit().await?;
                    tally(extra, &written)
                }
                Err(Error::Conflict { .. }) => {
                    tx.into_inner().rollback().await?;
                    Some("conflicts")
                }
                Err(e) => return Err(e.into()),
            };
            Extra::record(&extra.write_tx, t);
            if let Some(g) = granted {
                Extra::record(&extra.lock_hold, g);
            }
            Ok(outcome)
        }
        Strategy::Serializable => {
            for _attempt in 0..50 {
                let result: pgonce::Result<Outcome> = async {
                    let mut tx = pgonce::begin(pool, IsolationLevel::Serializable).await?;
                    let seen = scenario::read_open(&mut tx, entity).await?;
                    tokio::time::sleep(shape.eval).await; // connection held
                    let t = Instant::now();
                    let written =
                        scenario::apply(&mut tx, entity, Decision::toggle(&seen), 0).await?;
                    tx.commit().await?;
                    Extra::record(&extra.write_tx, t);
                    Ok(tally(extra, &written))
                }
                .await;
                match result {
                    Ok(outcome) => return Ok(outcome),
                    Err(e) if e.is_retryable() => {
                        extra.aborts.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            // Starved: 50 aborts in a row. Counted, not an error: it is what
            // SERIALIZABLE does to a hot entity.
            Ok(Some("gave_up"))
        }
        Strategy::RepeatableRead | Strategy::UniqueIndex => {
            anyhow::bail!("{} is replayed by the race, not measured", strategy.name())
        }
        Strategy::SessionLock => {
            let mut conn = pool.acquire().await?;
            scenario::lock_session(&mut conn, entity).await?;
            let granted = Instant::now();
            let seen = scenario::read_open(&mut conn, entity).await?;
            tokio::time::sleep(shape.eval).await; // connection and lock held
            let t = Instant::now();
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            let written = scenario::apply(&mut tx, entity, Decision::toggle(&seen), 0).await?;
            tx.commit().await?;
            Extra::record(&extra.write_tx, t);
            scenario::unlock_session(&mut conn, entity).await?;
            Extra::record(&extra.lock_hold, granted);
            Ok(tally(extra, &written))
        }
    }
}
