//! `pgonce bench service`: the incident service under load, with concurrent
//! declarations in one organization. 50 people declare incidents by hand in
//! one organization while the pipeline opens incidents in the same
//! organization; how long does a declaration take at p99, against the 3-second
//! declaration SLO (goal: at most 150 ms)? Run once per numbering strategy,
//! side by side, and first the pipeline alone, for its observations/s end to
//! end.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pgonce::{PgQueue, PgQueueOptions, Queue, SendMessage, SequenceStrategy, WorkerConfig};
use pgonce_incidents::model::{Declaration, Observation, Op, Rule, Singleton};
use pgonce_incidents::pipeline::SimulatedEvaluatorConfig;
use pgonce_incidents::runtime::{Runtime, RuntimeConfig, observations_queue_with};
use pgonce_incidents::{Service, ServiceConfig, invariants, store};
use serde_json::json;
use sqlx::PgPool;

use super::BenchArgs;
use super::measure::{closed_loop, median, round2, runs_row};
use crate::behind_pooler::bench_listen;
use crate::incident_run::{self, Retrier};
use crate::report::{Goal, Report, Row};
use crate::scratch::RunDatabase;

const DECLARERS: usize = 50;
const ENTITIES: usize = 20;
/// The service-level objective for declaring an incident: 3 s.
const SLO_MS: f64 = 3000.0;
const GOAL_P99_MS: f64 = 150.0;

/// The service's default first: the goal is judged on it.
const STRATEGIES: [SequenceStrategy; 3] = [
    SequenceStrategy::AdvisoryLock,
    SequenceStrategy::CounterRow,
    SequenceStrategy::TableLock,
];

fn runtime_config() -> RuntimeConfig {
    RuntimeConfig {
        workers: 2,
        worker: WorkerConfig {
            concurrency: 8,
            wait: Duration::from_millis(200),
            shutdown_deadline: Duration::from_secs(5),
            ..WorkerConfig::default()
        },
        // A short remote call; the bench is about the database side.
        evaluator: SimulatedEvaluatorConfig {
            latency: Duration::from_millis(10),
            jitter: Duration::from_millis(10),
            ..SimulatedEvaluatorConfig::default()
        },
        notifier: None,
        job_maintenance: false,
        ..RuntimeConfig::default()
    }
}

/// An organization whose every observation violates its policy, so each
/// message opens an incident (a numbered write in the organization).
async fn organization(pool: &PgPool, name: &str) -> anyhow::Result<i64> {
    let (org, _) = store::create_organization(pool, name).await?;
    let rule = Rule {
        attribute: "errors".into(),
        op: Op::Gt,
        value: 0.0,
    };
    store::create_policy(pool, org.id, "errors-seen", Singleton::Never, &rule).await?;
    Ok(org.id)
}

fn message(org: i64, i: usize) -> anyhow::Result<SendMessage> {
    let o = Observation {
        organization_id: org,
        entity: format!("svc-{}", i % ENTITIES),
        attributes: json!({ "errors": 1 }),
        message_id: None,
    };
    Ok(SendMessage::new(serde_json::to_string(&o)?).group(o.group()))
}

/// Keeps the queue topped up until `stop`; returns how many it sent.
async fn feed(queue: PgQueue, org: i64, stop: Arc<AtomicBool>) -> anyhow::Result<usize> {
    let mut sent = 0;
    while !stop.load(Ordering::Relaxed) {
        if queue.stats().await?.depth < 64 {
            let batch = (sent..sent + 10)
                .map(|i| message(org, i))
                .collect::<anyhow::Result<Vec<_>>>()?;
            queue.send_batch(batch).await?;
            sent += 10;
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(sent)
}

async fn processed(pool: &PgPool, org: i64) -> anyhow::Result<i64> {
    Ok(invariants::tallies(pool, &[org]).await?.messages_processed)
}

/// The observations queue's visibility timeout.
const VISIBILITY: Duration = Duration::from_secs(30);

/// How long the backlog's drain may go without processing a delivery
/// before it stops waiting: twice the visibility timeout, after which a
/// delivery that failed is received again.
const DRAIN_STALL: Duration = Duration::from_secs(2 * VISIBILITY.as_secs());

/// The verdict's line on the backlog: `drained` of `backlog` observations
/// processed when the drain ended. Fewer is work left when the drain
/// stalled, which a busy machine can leave: the run could not finish. It
/// is not a loss (the demo tells those apart, I6).
fn judge_backlog(report: &mut Report, drained: u64, backlog: u64) {
    report.verdict.finished(
        drained == backlog,
        format!("the pipeline drained {drained} of {backlog} observations"),
    );
}

/// A strategy's name in figure names: `advisory_lock`, `table_lock`...
fn figure_name(strategy: SequenceStrategy) -> String {
    strategy.name().replace('-', "_")
}

/// What one cell measured.
#[derive(Debug, Clone, Copy)]
struct Cell {
    p99_ms: f64,
    ops_per_sec: f64,
}

/// 50 people declare by hand in a new organization for `phase` while the
/// pipeline opens incidents there; the cell's row goes to the report.
async fn declarations(
    report: &mut Report,
    pool: &PgPool,
    queue: &PgQueue,
    numbering: SequenceStrategy,
    phase: Duration,
    run: usize,
) -> anyhow::Result<Cell> {
    let name = numbering.name();
    queue.purge().await?;
    let org = organization(pool, &format!("bench-{name}-{run}")).await?;
    let service = Service::new(
        pool.clone(),
        ServiceConfig {
            numbering,
            ..ServiceConfig::default()
        },
    )?;
    let runtime = Runtime::start(&service, queue.clone(), runtime_config())?;
    let stop = Arc::new(AtomicBool::new(false));
    let feeder = tokio::spawn(feed(queue.clone(), org, stop.clone()));
    let before = processed(pool, org).await?;
    let declaring = service.clone();
    let measured = closed_loop(
        &format!("declare ({name})"),
        DECLARERS,
        phase,
        move |worker, i| {
            let service = declaring.clone();
            async move {
                let d = Declaration {
                    title: format!("declared by person {worker}, #{i}"),
                    entity: None,
                    idempotency_key: None,
                };
                service.declare(org, &d, "bench").await?;
                Ok(None)
            }
        },
    )
    .await;
    let during = processed(pool, org).await? - before;
    stop.store(true, Ordering::Relaxed);
    feeder.await??;
    runtime.shutdown().await?;
    let counts = invariants::tallies(pool, &[org]).await?;
    if let Some(e) = &measured.first_error {
        report
            .verdict
            .check(false, format!("{name}: declaration failed: {e}"));
    }
    report.verdict.check(
        counts.declared as u64 == measured.ops,
        format!(
            "{name} (run {run}): {} declarations committed of {} acknowledged",
            counts.declared, measured.ops
        ),
    );
    let cell = Cell {
        p99_ms: measured.quantile_ms(0.99),
        ops_per_sec: measured.ops_per_sec(),
    };
    report.results.push(
        measured
            .row(name)
            .with("run", run)
            .with("declarers", DECLARERS)
            .with("pipeline_incidents", counts.incidents - counts.declared)
            .with(
                "pipeline_obs_per_sec",
                round2(during as f64 / measured.elapsed.as_secs_f64()),
            )
            .with("within_slo", cell.p99_ms <= SLO_MS),
    );
    Ok(cell)
}

pub(crate) async fn run(args: &BenchArgs, db: &RunDatabase) -> anyhow::Result<Report> {
    let pool = db.pool().clone();
    pgonce_incidents::migrate(&pool).await?;
    let mut report = Report::new("bench", "service", db.environment().await?);
    let phase = args.phase();
    let (listen, listen_off) = bench_listen(&pool).await?;
    let options = PgQueueOptions {
        listen,
        ..PgQueueOptions::default()
    };
    let queue = observations_queue_with(&pool, VISIBILITY, 10, options).await?;
    if let Some(reason) = listen_off {
        report.sections.insert(
            "skipped behind a transaction-mode pooler".into(),
            vec![Row::new("pgonce LISTEN").with("reason", reason)],
        );
    }

    // The pipeline alone: a backlog of observations, drained end to end.
    let org = organization(&pool, "bench-pipeline").await?;
    let service = Service::new(pool.clone(), ServiceConfig::default())?;
    let backlog = if args.quick { 400 } else { 2000 };
    let batch = (0..backlog)
        .map(|i| message(org, i))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for chunk in batch.chunks(10) {
        queue.send_batch(chunk.to_vec()).await?;
    }
    let started = Instant::now();
    let runtime = Runtime::start(&service, queue.clone(), runtime_config())?;
    let retrier = Retrier::new(Duration::from_secs(10));
    let drained = incident_run::drain(&pool, &[org], backlog as u64, DRAIN_STALL, &retrier).await?;
    let elapsed = started.elapsed();
    runtime.shutdown().await?;
    let pipeline_rate = drained as f64 / elapsed.as_secs_f64();
    report.results.push(
        Row::new("pipeline alone")
            .with("observations_per_sec", round2(pipeline_rate))
            .with("observations", drained)
            .with("evaluation_ms", "10-20"),
    );
    judge_backlog(&mut report, drained, backlog as u64);

    // Declarations by hand during pipeline creations, one cell per
    // strategy, each in an organization of its own. Cells run one after the
    // other, so a change in the machine's load between them biases a ratio:
    // with --repeat every run starts one cell further along, and each figure
    // is the median of the runs.
    //
    // Before the first cell, an unmeasured second of the same load. It opens
    // the pool's connections (26 open before it, 76 after) and prepares the
    // statements on them: without it that lands in the first cell's tail,
    // whose p99 was twice that of later cells with the same p50.
    let mut warm_up = Report::new("bench", "service warm-up", db.environment().await?);
    declarations(
        &mut warm_up,
        &pool,
        &queue,
        STRATEGIES[0],
        Duration::from_secs(1),
        0,
    )
    .await?;
    report.verdict.absorb("warm-up: ", &warm_up.verdict);
    let runs = args.repeat.max(1) as usize;
    let mut per_run: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for run in 0..runs {
        let mut order = STRATEGIES.to_vec();
        order.rotate_left(run % STRATEGIES.len());
        let mut cells = HashMap::new();
        for strategy in order {
            let cell = declarations(&mut report, &pool, &queue, strategy, phase, run + 1).await?;
            cells.insert(strategy, cell);
        }
        let mut figure = |name: String, value: f64| per_run.entry(name).or_default().push(value);
        let advisory = cells[&SequenceStrategy::AdvisoryLock];
        for strategy in STRATEGIES {
            let cell = cells[&strategy];
            let name = figure_name(strategy);
            figure(format!("{name}_p99_ms"), cell.p99_ms);
            if strategy != SequenceStrategy::AdvisoryLock {
                figure(
                    format!("{name}_p99_vs_advisory_p99"),
                    cell.p99_ms / advisory.p99_ms.max(1e-9),
                );
                figure(
                    format!("advisory_vs_{name}_declarations"),
                    advisory.ops_per_sec / cell.ops_per_sec.max(1e-9),
                );
            }
        }
    }
    let mut rows = Vec::new();
    for (name, values) in &per_run {
        if name.contains("_vs_") {
            report.ratio(name, median(values), 1.0);
        }
        rows.push(runs_row(name, values));
    }
    report.sections.insert(
        format!("figures of each run ({runs} runs, order rotated each run)"),
        rows,
    );

    let gaps = invariants::number_gaps(&pool).await?;
    report.verdict.check(
        gaps.is_empty(),
        format!(
            "I2: numbers 1..n in every organization ({} with gaps)",
            gaps.len()
        ),
    );
    let default = STRATEGIES[0];
    let p99 = median(&per_run[&format!("{}_p99_ms", figure_name(default))]);
    report.goal(
        Goal::ms_at_most("declaration_p99_ms", GOAL_P99_MS)
            .measured(Some(round2(p99)))
            .note(format!(
                "median of {runs} runs, 50 declarers + pipeline in one organization, numbering {}; declaration SLO {SLO_MS} ms",
                default.name()
            )),
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Environment, Outcome};

    /// A backlog not drained when the drain stalled is work left, which a
    /// busy machine can leave: the bench could not finish, it found no
    /// violation (losing a message is the demo's to find, I6).
    #[test]
    fn a_backlog_left_is_unfinished_not_a_violation() {
        let mut report = Report::new("bench", "service", Environment::unknown());
        judge_backlog(&mut report, 400, 400);
        assert_eq!(report.verdict.outcome(), Outcome::Ok);
        judge_backlog(&mut report, 250, 400);
        assert_eq!(
            report.verdict.outcome(),
            Outcome::Unfinished,
            "{:?}",
            report.verdict
        );
    }
}
