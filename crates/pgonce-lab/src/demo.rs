//! `pgonce demo`: the incident service end to end on a throwaway database,
//! under the faults it exists for, then every invariant checked in the
//! database.
//!
//! The run: organizations, entities and policies (a singleton, a
//! non-singleton, and one decided per entity at run time); a local webhook
//! receiver that sometimes fails and sometimes answers too late; observations
//! produced onto the FIFO queue with injected duplicate sends; a visibility
//! timeout shorter than the slow tail of the evaluation, so the slow
//! messages are delivered again while their first worker is still busy;
//! people declaring, acknowledging and resolving incidents by hand; and,
//! part-way, one worker runtime killed (its tasks aborted mid-message; its
//! messages and claimed notifications must come back). The report counts what happened and
//! checks I1, I2, I3 and I6; the exit code is 0 iff all hold.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use pgonce::job::{ReaperConfig, RedriverConfig, RetryPolicy};
use pgonce::{PgQueue, Queue, SendMessage, WorkerConfig};
use pgonce_incidents::model::{
    Declaration, IncidentFilter, Lifecycle, Observation, Op, Rule, Singleton,
};
use pgonce_incidents::pipeline::{PipelineCounters, PipelineSnapshot, SimulatedEvaluatorConfig};
use pgonce_incidents::runtime::{Runtime, RuntimeConfig, observations_queue};
use pgonce_incidents::webhook::{ReceiverFaults, WebhookReceiver};
use pgonce_incidents::{NotifierConfig, Service, ServiceConfig, invariants, store};
use rand::Rng;
use serde_json::json;

use crate::report::{Report, Row};
use crate::scratch::RunDatabase;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Percent of entities whose incidents take the guarded write; the rest
    /// take the plain two-transaction path. 0 shows what breaks without it.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u8).range(0..=100))]
    rollout: u8,
    /// Observations to produce.
    #[arg(long, default_value_t = 1500)]
    observations: usize,
    /// Organizations (each with its entities and three policies).
    #[arg(long, default_value_t = 3)]
    organizations: usize,
    /// Entities per organization.
    #[arg(long, default_value_t = 25)]
    entities: usize,
    /// Share of observations sent twice by the producer (same
    /// deduplication id: the queue drops the second).
    #[arg(long, default_value_t = 0.1)]
    duplicates: f64,
    /// The queue's visibility timeout, in ms: shorter than the slow tail of
    /// the evaluation.
    #[arg(long, default_value_t = 1000)]
    visibility_ms: u64,
    /// Share of policy evaluations that take longer than the visibility
    /// timeout (the message is then delivered again while still being
    /// evaluated).
    #[arg(long, default_value_t = 0.05)]
    slow_rate: f64,
    /// No people declaring, acknowledging and resolving by hand (so every
    /// duplicate the pipeline makes stays OPEN for the check).
    #[arg(long)]
    no_people: bool,
    /// Give up waiting for the pipeline after this many seconds.
    #[arg(long, default_value_t = 100)]
    deadline_secs: u64,
}

/// Three policies per organization: one incident at a time, every time, and
/// one at a time only for entities marked so (decided at run time).
const POLICIES: [(&str, Singleton, &str, Op, f64); 3] = [
    ("cpu-saturated", Singleton::Always, "cpu", Op::Gt, 90.0),
    ("errors-seen", Singleton::Never, "errors", Op::Gt, 2.0),
    (
        "latency-high",
        Singleton::PerEntity,
        "latency_ms",
        Op::Gte,
        900.0,
    ),
];

struct Setup {
    organizations: Vec<i64>,
    /// (organization, entity external id)
    entities: Vec<(i64, String)>,
}

async fn set_up(pool: &sqlx::PgPool, args: &DemoArgs) -> anyhow::Result<Setup> {
    let mut setup = Setup {
        organizations: Vec::new(),
        entities: Vec::new(),
    };
    for o in 0..args.organizations {
        let (org, _key) = store::create_organization(pool, &format!("org-{o}")).await?;
        for (name, singleton, attribute, op, value) in POLICIES {
            let rule = Rule {
                attribute: attribute.into(),
                op,
                value,
            };
            store::create_policy(pool, org.id, name, singleton, &rule).await?;
        }
        for e in 0..args.entities {
            let external = format!("svc-{e}");
            let entity = store::upsert_entity(pool, org.id, &external, &json!({})).await?;
            // Half the entities start as singletons for the per-entity policy.
            if e % 2 == 0 {
                store::set_entity_singleton(pool, org.id, entity.id, true).await?;
            }
            setup.entities.push((org.id, external));
        }
        setup.organizations.push(org.id);
    }
    Ok(setup)
}

/// What the producer did.
#[derive(Default)]
struct Produced {
    /// Ids of the valid observations accepted by the queue (I6 checks each).
    sent: BTreeSet<String>,
    duplicate_sends: u64,
    dropped_by_dedup: u64,
    malformed: u64,
}

fn observation(rng: &mut impl Rng, org: i64, entity: &str) -> Observation {
    Observation {
        organization_id: org,
        entity: entity.to_owned(),
        attributes: json!({
            "cpu": rng.random_range(0..100),
            "errors": rng.random_range(0..5),
            "latency_ms": rng.random_range(100..1000),
        }),
        message_id: None,
    }
}

async fn produce(queue: &PgQueue, setup: &Setup, args: &DemoArgs) -> anyhow::Result<Produced> {
    let mut produced = Produced::default();
    let mut batch = Vec::new();
    for i in 0..args.observations {
        let message = {
            let mut rng = rand::rng();
            let (org, entity) = &setup.entities[rng.random_range(0..setup.entities.len())];
            let o = observation(&mut rng, *org, entity);
            let body = serde_json::to_string(&o)?;
            let twice = rng.random::<f64>() < args.duplicates;
            let m = SendMessage::new(body)
                .group(o.group())
                .dedup(format!("obs-{i}"));
            (m, twice)
        };
        batch.push(message);
        if batch.len() == 10 || i + 1 == args.observations {
            for (m, twice) in batch.drain(..) {
                let sent = queue.send(m.clone()).await?;
                produced.sent.insert(sent.id);
                if twice {
                    // The producer retries a send it thinks failed: same
                    // deduplication id, so the queue keeps one message.
                    produced.duplicate_sends += 1;
                    if queue.send(m).await?.duplicate {
                        produced.dropped_by_dedup += 1;
                    }
                }
            }
            tokio::task::yield_now().await;
        }
    }
    // Poison: bodies no handler can use. They must end in the dead-letter
    // queue, not vanish and not block their group forever.
    for (i, body) in [
        "not json",
        r#"{"organization_id": 1, "entity": "", "attributes": {}}"#,
        r#"{"organization_id": 999999, "entity": "ghost", "attributes": {}}"#,
        // jsonb cannot hold \u0000: refused as malformed, never retried
        // into the database.
        r#"{"organization_id": 1, "entity": "nul", "attributes": {"k": "\u0000"}}"#,
    ]
    .into_iter()
    .enumerate()
    {
        queue
            .send(SendMessage::new(body).group(format!("poison-{i}")))
            .await?;
        produced.malformed += 1;
    }
    Ok(produced)
}

/// People at work: declare now and then, acknowledge and resolve open
/// incidents (resolving lets singleton policies open again), and turn some
/// entities' singleton flag off at run time.
async fn people(
    service: Service,
    organizations: Vec<i64>,
    entities: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<u64> {
    let mut actions = 0;
    let mut tick = 0u64;
    while !*stop.borrow() {
        tick += 1;
        let org = organizations[(tick as usize) % organizations.len()];
        if tick.is_multiple_of(4) {
            let d = Declaration {
                title: format!("customer report #{tick}"),
                entity: Some(format!("svc-{}", tick as usize % entities)),
                idempotency_key: Some(format!("pager-{tick}")),
            };
            service.declare(org, &d, "on-call").await?;
            // The pager retries: the key makes it one incident.
            service.declare(org, &d, "on-call").await?;
            actions += 1;
        }
        let open = service
            .list(
                org,
                &IncidentFilter {
                    lifecycle: Some(Lifecycle::Open),
                    limit: Some(5),
                    ..Default::default()
                },
            )
            .await?;
        for (n, incident) in open.iter().enumerate() {
            let done = if n % 2 == 0 {
                service.resolve(org, incident.id, "on-call").await
            } else {
                service.acknowledge(org, incident.id, "on-call").await
            };
            match done {
                Ok(_) => actions += 1,
                // The pipeline or another person got there first.
                Err(pgonce_incidents::Error::InvalidTransition { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if tick.is_multiple_of(10) {
            let entity = store::find_entity(
                service.pool(),
                org,
                &format!("svc-{}", (tick as usize / 10) * 2 % entities),
            )
            .await;
            if let Ok(entity) = entity {
                store::set_entity_singleton(service.pool(), org, entity.id, false).await?;
            }
        }
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    Ok(actions)
}

fn runtime_config(args: &DemoArgs, webhook: &str, notifier: bool) -> RuntimeConfig {
    let visibility = Duration::from_millis(args.visibility_ms);
    let mut notify = NotifierConfig::new(webhook);
    notify.timeout = Duration::from_millis(500);
    notify.lease = Duration::from_secs(2);
    notify.idle = Duration::from_millis(50);
    notify.retry = RetryPolicy {
        base: Duration::from_millis(100),
        max: Duration::from_secs(1),
        jitter: 0.25,
    };
    RuntimeConfig {
        workers: 2,
        worker: WorkerConfig {
            concurrency: 12,
            batch: 10,
            wait: Duration::from_millis(500),
            // No heartbeat: a slow evaluation outlives its visibility
            // timeout and the message is delivered again, as in the seed.
            heartbeat_interval: None,
            failure_visibility: Some(Duration::from_millis(100)),
            shutdown_deadline: Duration::from_secs(5),
            ..WorkerConfig::default()
        },
        evaluator: SimulatedEvaluatorConfig {
            latency: Duration::from_millis(40),
            jitter: Duration::from_millis(80),
            failure_rate: 0.01,
            // The slow tail outlives the visibility timeout: delivered again
            // while its first worker is still evaluating.
            slow_rate: args.slow_rate,
            slow_latency: visibility + Duration::from_millis(500),
        },
        notifier: notifier.then_some(notify),
        job_maintenance: true,
        reaper: ReaperConfig {
            interval: Duration::from_millis(200),
            ..ReaperConfig::default()
        },
        redriver: RedriverConfig {
            interval: Duration::from_millis(100),
            ..RedriverConfig::default()
        },
    }
}

fn snapshot_sum(counters: &[Arc<PipelineCounters>]) -> PipelineSnapshot {
    let mut total = PipelineSnapshot::default();
    for c in counters {
        total += c.snapshot();
    }
    total
}

pub async fn run(args: &DemoArgs, database_url: Option<&str>) -> anyhow::Result<Report> {
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.duplicates) && (0.0..=1.0).contains(&args.slow_rate),
        "--duplicates and --slow-rate must be in [0, 1]"
    );
    anyhow::ensure!(
        args.organizations >= 1 && args.entities >= 1 && args.observations >= 1,
        "--organizations, --entities and --observations must be at least 1"
    );
    let started = Instant::now();
    let db = RunDatabase::open(database_url, "demo", 40).await?;
    let pool = db.pool().clone();
    pgonce_incidents::migrate(&pool)
        .await
        .context("applying the service's migrations")?;
    store::set_rollout_percent(&pool, args.rollout).await?;
    let service = Service::new(pool.clone(), ServiceConfig::default())?;
    let setup = set_up(&pool, args).await?;
    let receiver = WebhookReceiver::start(ReceiverFaults {
        fail_rate: 0.05,
        late_rate: 0.05,
        late_by: Duration::from_millis(800),
    })
    .await?;
    let visibility = Duration::from_millis(args.visibility_ms);
    let queue = observations_queue(&pool, visibility, 10).await?;

    // Two worker runtimes (each what one `pgonce worker` process runs, in
    // this process); the second also runs the notifier, and is killed
    // part-way: dropping a Runtime aborts its tasks where they stand, with
    // no ack, heartbeat or completion, as a killed process would.
    let first = Runtime::start(
        &service,
        queue.clone(),
        runtime_config(args, receiver.url(), false),
    )?;
    let second = Runtime::start(
        &service,
        queue.clone(),
        runtime_config(args, receiver.url(), true),
    )?;
    let mut counters = vec![first.pipeline(), second.pipeline()];
    let (stop_people, people_stop) = tokio::sync::watch::channel(args.no_people);
    let people = tokio::spawn(people(
        service.clone(),
        setup.organizations.clone(),
        args.entities,
        people_stop,
    ));

    let produced = produce(&queue, &setup, args).await?;
    let expected = produced.sent.len() as u64;

    let bar = ProgressBar::new(expected);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} observations {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix("pipeline");
    let deadline = Instant::now() + Duration::from_secs(args.deadline_secs);
    let mut second = Some(second);
    let mut replacement = None;
    let mut finished = false;
    while Instant::now() < deadline {
        let tallies = invariants::tallies(&pool, &setup.organizations).await?;
        let done = tallies.messages_processed as u64;
        bar.set_position(done);
        let seen = snapshot_sum(&counters);
        bar.set_message(format!(
            "{} incidents, {} redeliveries, {} conflicts",
            tallies.incidents, seen.redeliveries, seen.conflicts
        ));
        if second.is_some() && done * 5 >= expected * 2 {
            // Kill a worker runtime mid-flight, notifier included; start a
            // replacement as an orchestrator would.
            drop(second.take());
            bar.println("demo: killed worker runtime 2 (its messages and claimed notifications must come back)");
            let r = Runtime::start(
                &service,
                queue.clone(),
                runtime_config(args, receiver.url(), true),
            )?;
            counters.push(r.pipeline());
            replacement = Some(r);
        }
        if done >= expected {
            let stats = queue.stats().await?;
            let unnotified = invariants::not_notified_once(&pool, &setup.organizations).await?;
            if stats.depth == 0 && stats.in_flight == 0 && unnotified.is_empty() {
                finished = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bar.finish_and_clear();
    let _ = stop_people.send(true);
    let human_actions = people.await.context("people task")??;
    let mut summary = first.shutdown().await?;
    if let Some(r) = replacement {
        let s = r.shutdown().await?;
        summary.workers += s.workers;
        summary.notifications += s.notifications;
    }
    // The people may have opened incidents after the pipeline finished;
    // give the notifier a moment to catch up before checking I3.
    let settle = Instant::now() + Duration::from_secs(10);
    let notifier = pgonce_incidents::Notifier::new(
        &service,
        runtime_config(args, receiver.url(), true)
            .notifier
            .expect("set"),
    )?;
    while Instant::now() < settle
        && !invariants::not_notified_once(&pool, &setup.organizations)
            .await?
            .is_empty()
    {
        let _ = notifier.run_once().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let sent: Vec<String> = produced.sent.iter().cloned().collect();
    let checked = invariants::check(&pool, &setup.organizations, &sent).await?;
    let tallies = invariants::tallies(&pool, &setup.organizations).await?;
    let stats = queue.stats().await?;
    let pipeline = snapshot_sum(&counters);
    let hook = receiver.stats();

    let mut report = Report::new("demo", "incident-service", db.environment().await?);
    let figures: [(&str, &str, serde_json::Value); 25] = [
        ("pipeline", "observations sent", expected.into()),
        (
            "pipeline",
            "duplicate sends (same dedup id)",
            produced.duplicate_sends.into(),
        ),
        (
            "pipeline",
            "dropped by the queue's dedup",
            produced.dropped_by_dedup.into(),
        ),
        ("pipeline", "deliveries handled", pipeline.messages.into()),
        ("pipeline", "redeliveries", pipeline.redeliveries.into()),
        (
            "pipeline",
            "acks refused as stale",
            summary.workers.stale.into(),
        ),
        (
            "pipeline",
            "evaluation failures (retried)",
            pipeline.evaluation_failures.into(),
        ),
        (
            "incidents",
            "opened by the pipeline",
            pipeline.incidents_opened.into(),
        ),
        (
            "incidents",
            "guarded writes",
            pipeline.guarded_writes.into(),
        ),
        ("incidents", "plain writes", pipeline.plain_writes.into()),
        (
            "incidents",
            "conflicts caught by the guard",
            pipeline.conflicts.into(),
        ),
        (
            "incidents",
            "violations already open",
            pipeline.already_open.into(),
        ),
        (
            "incidents",
            "opened twice for one message",
            tallies.opened_twice_for_one_message.into(),
        ),
        (
            "incidents",
            "declared/acked/resolved by people",
            human_actions.into(),
        ),
        ("incidents", "total", tallies.incidents.into()),
        (
            "notifications",
            "notified (one row per incident)",
            tallies.notifications.into(),
        ),
        ("notifications", "webhook requests", hook.requests.into()),
        (
            "notifications",
            "duplicates dropped by idempotency key",
            hook.duplicates.into(),
        ),
        (
            "notifications",
            "refused by the receiver (500)",
            hook.refused.into(),
        ),
        (
            "notifications",
            "answered after the sender's timeout",
            hook.late.into(),
        ),
        (
            "queue",
            "malformed messages sent",
            produced.malformed.into(),
        ),
        (
            "queue",
            "dead-lettered",
            stats.dead_letter_depth.unwrap_or(0).into(),
        ),
        (
            "queue",
            "left in the queue",
            (stats.depth + stats.in_flight).into(),
        ),
        ("run", "guard rollout (percent)", args.rollout.into()),
        (
            "run",
            "seconds",
            ((started.elapsed().as_secs_f64() * 10.0).round() / 10.0).into(),
        ),
    ];
    for (area, figure, value) in figures {
        report
            .results
            .push(Row::new(area).with("figure", figure).with("value", value));
    }
    let invariant_rows = vec![
        Row::new("I1")
            .with(
                "invariant",
                "a singleton policy never has two OPEN incidents for one entity",
            )
            .with("held", checked.i1())
            .with("violations", checked.i1_duplicate_open.len()),
        Row::new("I2")
            .with("invariant", "incident numbers are 1..n per organization")
            .with("held", checked.i2())
            .with("violations", checked.i2_number_gaps.len()),
        Row::new("I3")
            .with("invariant", "each incident is notified exactly once")
            .with("held", checked.i3())
            .with("violations", checked.i3_not_notified_once.len()),
        Row::new("I6")
            .with("invariant", "no observation lost")
            .with("held", checked.i6())
            .with("violations", checked.i6_unprocessed.len()),
    ];
    report.sections.insert("invariants".into(), invariant_rows);

    let v = &mut report.verdict;
    v.check(
        finished,
        format!("the pipeline drained within {} s", args.deadline_secs),
    );
    v.check(
        checked.i1(),
        format!(
            "I1: {} incidents opened while another of their singleton (policy, entity) was OPEN{}",
            checked.i1_duplicate_open.len(),
            if args.rollout < 100 {
                format!(" (rollout {}%: the plain path has no guard)", args.rollout)
            } else {
                String::new()
            }
        ),
    );
    v.check(
        checked.i2(),
        format!(
            "I2: {} organizations with gaps or duplicates",
            checked.i2_number_gaps.len()
        ),
    );
    v.check(
        checked.i3(),
        format!(
            "I3: {} incidents not notified exactly once; the receiver dropped {} duplicate deliveries by key",
            checked.i3_not_notified_once.len(),
            hook.duplicates
        ),
    );
    v.check(
        checked.i6() && stats.dead_letter_depth.unwrap_or(0) == produced.malformed,
        format!(
            "I6: {} of {} observations unprocessed; {} malformed messages in the dead-letter queue",
            checked.i6_unprocessed.len(),
            expected,
            stats.dead_letter_depth.unwrap_or(0)
        ),
    );
    drop((receiver, service, queue, notifier));
    db.close().await?;
    Ok(report)
}
