//! The incident service run under faults, written once: what `pgonce demo`
//! renders, what the pipeline's end-to-end tests assert on, and what
//! `pgonce bench service` starts its runtimes with.
//!
//! One run: organizations, entities and policies (a singleton, a
//! non-singleton, and one decided per entity at run time); a local webhook
//! receiver that sometimes fails and sometimes answers too late;
//! observations produced onto the FIFO queue with injected duplicate sends
//! and poison messages; a visibility timeout shorter than the slow tail of
//! the evaluation; people declaring, acknowledging and resolving by hand;
//! part-way, one worker runtime killed (tasks aborted mid-message) and
//! replaced; optionally the database server restarted. Then it waits until
//! every notification job is terminal, within a deadline derived from the
//! notifier's lease and retry schedule (`settle_bound`), and checks the
//! invariants in the database. The result is a [`IncidentRunOutcome`]: a value,
//! not a report, so that the demo renders it and tests assert on it.
//!
//! It lives in the lab, not in `pgonce-incidents`: a deployed `pgonce
//! serve` links `pgonce-incidents` but never the lab (the CLI's `lab`
//! feature is off by default), so neither the fault injection nor the
//! test-only cluster restart can reach a production binary, and no cargo
//! feature of the service has to be kept in step with its tests.
//!
//! The run's own drivers (producer, progress loop, people, checks) retry
//! what a real client would retry: connection errors, an administrator's
//! shutdown (57P01), a server starting or stopping (57P03), the 08xxx
//! class ([`is_transient`]). Every retried call is safe to repeat: sends
//! carry deduplication ids, declarations idempotency keys, and the people's
//! transitions treat "already done" as done.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::ProgressBar;
use pgonce::job::{ReaperConfig, RedriverConfig, RetryPolicy};
use pgonce::{
    Listen, PgQueueOptions, PoolerProblem, Queue, QueueStats, SendMessage, WorkerConfig,
    WorkerCounters,
};
use pgonce_incidents::invariants::{InvariantReport, NotNotifiedOnce, Tallies};
use pgonce_incidents::model::{
    Declaration, IncidentFilter, Lifecycle, Observation, Op, Rule, Singleton,
};
use pgonce_incidents::pipeline::{PipelineCounters, PipelineSnapshot, SimulatedEvaluatorConfig};
use pgonce_incidents::runtime::{
    OBSERVATIONS_DEAD_LETTERS, Runtime, RuntimeConfig, observations_queue_with,
};
use pgonce_incidents::service::NOTIFY_JOB_KIND;
use pgonce_incidents::{NotifierConfig, Service, ServiceConfig, invariants, store};
use pgonce_testkit::webhook::{ReceiverFaults, ReceiverStats, WebhookReceiver};
use rand::Rng;
use serde::Serialize;
use serde_json::json;
use sqlx::PgPool;

use crate::scratch::Restarter;

mod audit;

use audit::PgAudit;
pub use audit::{DeliveryAudit, DoubledDelivery, QueueAudit, SqsAudit};

/// What to run.
#[derive(Debug, Clone)]
pub struct IncidentRunConfig {
    /// Percent of entities whose incidents take the guarded write.
    pub(crate) rollout: u8,
    /// Valid observations to send, each about a random entity; the
    /// duplicates are sent on top of these.
    pub observations: usize,
    pub(crate) organizations: usize,
    /// Entities per organization.
    pub entities: usize,
    /// Share of observations sent twice (same deduplication id).
    pub(crate) duplicates: f64,
    /// People declaring, acknowledging and resolving by hand.
    pub(crate) people: bool,
    /// The queue's visibility timeout.
    pub visibility: Duration,
    /// Deliveries of a message before it is dead-lettered.
    pub max_receive_count: u32,
    /// The runtimes' configuration; its `notifier` is what the second
    /// runtime (the one killed) and the settle phase run.
    pub runtime: RuntimeConfig,
    /// What the webhook receiver refuses or answers late, on purpose.
    pub receiver: ReceiverFaults,
    /// Attempts of a notification before it is dead. Far above the
    /// service's default: the receiver refuses or answers late on purpose,
    /// and on a loaded machine an answer in time can come late too, so a
    /// handful of attempts could all fail. A notification dead for that
    /// would fail I3 for the machine's load, not for a fault of the
    /// pipeline; at 50 attempts, even half of them failing leaves one
    /// chance in 10^15.
    pub notify_max_attempts: i32,
    /// Kill the second runtime once this share of the observations was
    /// processed (and start a replacement).
    pub(crate) kill_after: f64,
    /// How long the pipeline may go without progress (more deliveries or
    /// dead letters, fewer messages left) before the run stops waiting for
    /// it to drain: a bound on a stall, not on the run.
    pub drain_deadline: Duration,
    /// Where the queue's long polls LISTEN: [`Listen::Direct`] or
    /// [`Listen::Off`] when the run's pool goes through a transaction-mode
    /// pooler. Default [`Listen::Pool`].
    pub listen: Listen,
}

impl IncidentRunConfig {
    /// The demo's run: `visibility` shorter than the slow tail
    /// (`slow_rate` of the evaluations take `visibility + 500 ms`).
    pub(crate) fn demo(
        visibility: Duration,
        slow_rate: f64,
        webhook_timeout: Duration,
    ) -> IncidentRunConfig {
        let mut notify = NotifierConfig::new("http://127.0.0.1:9/set-at-run-time");
        notify.timeout = webhook_timeout;
        notify.lease = Duration::from_secs(2);
        notify.idle = Duration::from_millis(50);
        notify.retry = RetryPolicy {
            base: Duration::from_millis(100),
            max: Duration::from_secs(1),
            jitter: 0.25,
        };
        IncidentRunConfig {
            rollout: 100,
            observations: 1500,
            organizations: 3,
            entities: 25,
            duplicates: 0.1,
            people: true,
            visibility,
            max_receive_count: 10,
            runtime: RuntimeConfig {
                workers: 2,
                worker: WorkerConfig {
                    concurrency: 12,
                    batch: 10,
                    wait: Duration::from_millis(500),
                    // No heartbeat: a slow evaluation outlives its
                    // visibility timeout and the message is delivered
                    // again, to a second worker: the duplicate-incident race.
                    heartbeat_interval: None,
                    failure_visibility: Some(Duration::from_millis(100)),
                    shutdown_deadline: Duration::from_secs(5),
                    ..WorkerConfig::default()
                },
                evaluator: SimulatedEvaluatorConfig {
                    latency: Duration::from_millis(40),
                    jitter: Duration::from_millis(80),
                    failure_rate: 0.01,
                    // The slow tail outlives the visibility timeout:
                    // delivered again while its first worker is still
                    // evaluating.
                    slow_rate,
                    slow_latency: visibility + Duration::from_millis(500),
                },
                notifier: Some(notify),
                job_maintenance: true,
                reaper: ReaperConfig {
                    interval: Duration::from_millis(200),
                    ..ReaperConfig::default()
                },
                redriver: RedriverConfig {
                    interval: Duration::from_millis(100),
                    ..RedriverConfig::default()
                },
                ledger_cleaner: None,
            },
            receiver: ReceiverFaults {
                fail_rate: 0.05,
                late_rate: 0.05,
                late_by: Duration::from_millis(800),
            },
            notify_max_attempts: 50,
            kill_after: 0.4,
            drain_deadline: Duration::from_secs(100),
            listen: Listen::Pool,
        }
    }

    /// A reduced run for the test suite: one organization, fewer
    /// observations, shorter timeouts; the same faults.
    pub fn quick() -> IncidentRunConfig {
        let visibility = Duration::from_millis(300);
        let mut c = IncidentRunConfig::demo(visibility, 0.1, Duration::from_millis(300));
        c.observations = 150;
        c.organizations = 1;
        c.entities = 6;
        c.max_receive_count = 20;
        c.receiver = ReceiverFaults {
            fail_rate: 0.1,
            late_rate: 0.1,
            late_by: Duration::from_millis(500),
        };
        let r = &mut c.runtime;
        r.worker.concurrency = 8;
        r.worker.wait = Duration::from_millis(200);
        r.worker.failure_visibility = Some(Duration::from_millis(50));
        r.worker.shutdown_deadline = Duration::from_secs(2);
        r.evaluator = SimulatedEvaluatorConfig {
            latency: Duration::from_millis(5),
            jitter: Duration::from_millis(10),
            failure_rate: 0.02,
            slow_rate: 0.1,
            slow_latency: visibility + Duration::from_millis(300),
        };
        let n = r.notifier.as_mut().expect("set by demo()");
        n.lease = Duration::from_secs(1);
        n.idle = Duration::from_millis(20);
        n.retry = RetryPolicy {
            base: Duration::from_millis(50),
            max: Duration::from_millis(200),
            jitter: 0.0,
        };
        r.reaper.interval = Duration::from_millis(100);
        r.redriver.interval = Duration::from_millis(50);
        // The bound is on a stall, not on the run (`StallWatch`): the
        // longest quiet spell is on SQS, whose malformed messages take 20
        // receives a whole second apart before they are dead-lettered,
        // with nothing else left to move. It sits far above that.
        c.drain_deadline = Duration::from_secs(240);
        c
    }

    /// The visibility timeout rounded up to whole seconds, as SQS takes it,
    /// and the slow tail kept the same margin past it (so slow messages are
    /// still delivered again while being evaluated).
    pub fn whole_second_visibility(mut self) -> IncidentRunConfig {
        let evaluator = &mut self.runtime.evaluator;
        let margin = evaluator.slow_latency.saturating_sub(self.visibility);
        self.visibility = Duration::from_secs(self.visibility.as_secs_f64().ceil().max(1.0) as u64);
        evaluator.slow_latency = self.visibility + margin;
        self
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.duplicates)
                && (0.0..=1.0).contains(&self.runtime.evaluator.slow_rate),
            "--duplicates and --slow-rate must be in [0, 1]"
        );
        anyhow::ensure!(
            self.organizations >= 1 && self.entities >= 1 && self.observations >= 1,
            "--organizations, --entities and --observations must be at least 1"
        );
        anyhow::ensure!(
            self.runtime.notifier.is_some(),
            "the incident run needs a notifier configuration"
        );
        Ok(())
    }

    fn notifier(&self, webhook: &str) -> NotifierConfig {
        let mut n = self.runtime.notifier.clone().expect("validated");
        n.webhook_url = webhook.to_owned();
        n
    }

    fn runtime_config(&self, webhook: &str, notifier: bool) -> RuntimeConfig {
        let mut r = self.runtime.clone();
        r.notifier = notifier.then(|| self.notifier(webhook));
        r
    }
}

/// How long notification jobs with at most `attempts` attempts left can
/// take to become terminal, at worst, with a reaper, a re-driver and a
/// notifier running. Each attempt either
/// * was claimed by a notifier that stopped or died: the lease (the
///   notifier holds it without a heartbeat) runs out, and the reaper's next
///   pass returns the job; or
/// * failed (error status, timeout): the backoff of the retry schedule at
///   most (`max` with full jitter), and the re-driver's next pass returns it;
///
/// and is then claimed within the notifier's idle pause. Doubled: the
/// machine may be busy, and this bounds a wait, it is not a verdict.
pub(crate) fn settle_bound(
    notifier: &NotifierConfig,
    runtime: &RuntimeConfig,
    attempts: u32,
) -> Duration {
    let crashed = notifier.lease + runtime.reaper.interval;
    let failed = notifier.timeout
        + notifier.retry.max.mul_f64(1.0 + notifier.retry.jitter)
        + runtime.redriver.interval;
    let attempt = crashed.max(failed) + notifier.idle;
    attempt * attempts.max(1) * 2
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

/// True for the database errors a client retries: the connection failed
/// or was cut (I/O, protocol, pool timeout while the server is away), an
/// administrator or a restart ended the session (57P01, 57P02), the server
/// is starting up or shutting down (57P03), or any connection exception
/// (08xxx), or a pooler in between cannot reach the server or take
/// another client now.
pub fn is_transient(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        // A pooler that cannot reach the server (it is restarting) or has
        // no room for another client now is a wait, not a set-up mistake.
        let pooler = |e: &pgonce::Error| {
            matches!(
                e,
                pgonce::Error::Pooler {
                    problem: PoolerProblem::ServerUnreachable | PoolerProblem::ClientLimit,
                    ..
                }
            )
        };
        if cause.downcast_ref::<pgonce::Error>().is_some_and(pooler)
            || matches!(
                cause.downcast_ref::<pgonce_incidents::Error>(),
                Some(pgonce_incidents::Error::Pgonce(e)) if pooler(e)
            )
        {
            return true;
        }
        let sqlx = cause
            .downcast_ref::<sqlx::Error>()
            .or(match cause.downcast_ref::<pgonce::Error>() {
                Some(pgonce::Error::Database(e)) => Some(e),
                _ => None,
            })
            .or(match cause.downcast_ref::<pgonce_incidents::Error>() {
                Some(pgonce_incidents::Error::Pgonce(pgonce::Error::Database(e))) => Some(e),
                _ => None,
            });
        sqlx.is_some_and(transient_sqlx)
    })
}

fn transient_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(d) => d
            .code()
            .is_some_and(|c| c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03")),
        _ => false,
    }
}

/// Retries transient database errors (see [`is_transient`]) for up to
/// `give_up_after`, counting each retry.
#[derive(Debug)]
pub struct Retrier {
    give_up_after: Duration,
    retried: AtomicU64,
}

impl Retrier {
    /// A retrier that gives up once transient errors have lasted
    /// `give_up_after`.
    pub fn new(give_up_after: Duration) -> Retrier {
        Retrier {
            give_up_after,
            retried: AtomicU64::new(0),
        }
    }

    /// Calls made again after a transient error.
    pub fn retried(&self) -> u64 {
        self.retried.load(Ordering::Relaxed)
    }

    /// Runs `call` until it succeeds, fails for good, or transient errors
    /// have lasted `give_up_after`. `call` must be safe to repeat.
    pub async fn run<T, E, F, Fut>(&self, what: &str, call: F) -> anyhow::Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: Into<anyhow::Error>,
    {
        Ok(self.run_noting_errors(what, call).await?.0)
    }

    /// [`Retrier::run`], also handing back the transient errors it
    /// retried after, in order.
    pub(crate) async fn run_noting_errors<T, E, F, Fut>(
        &self,
        what: &str,
        mut call: F,
    ) -> anyhow::Result<(T, Vec<String>)>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: Into<anyhow::Error>,
    {
        let started = Instant::now();
        let mut pause = Duration::from_millis(50);
        let mut errors = Vec::new();
        loop {
            match call().await {
                Ok(v) => return Ok((v, errors)),
                Err(e) => {
                    let e: anyhow::Error = e.into();
                    if !is_transient(&e) || started.elapsed() >= self.give_up_after {
                        return Err(e.context(what.to_owned()));
                    }
                    self.retried.fetch_add(1, Ordering::Relaxed);
                    tracing::info!("{what}: retrying after a transient database error: {e:#}");
                    errors.push(format!("{e:#}"));
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

struct Setup {
    organizations: Vec<i64>,
    /// (organization, entity external id)
    entities: Vec<(i64, String)>,
}

async fn set_up(pool: &PgPool, config: &IncidentRunConfig) -> anyhow::Result<Setup> {
    let mut setup = Setup {
        organizations: Vec::new(),
        entities: Vec::new(),
    };
    for o in 0..config.organizations {
        let (org, _key) = store::create_organization(pool, &format!("org-{o}")).await?;
        for (name, singleton, attribute, op, value) in POLICIES {
            let rule = Rule {
                attribute: attribute.into(),
                op,
                value,
            };
            store::create_policy(pool, org.id, name, singleton, &rule).await?;
        }
        for e in 0..config.entities {
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
#[derive(Debug, Clone, Default, Serialize)]
pub struct Produced {
    /// Ids of the valid observations accepted by the queue (I6 checks each).
    pub(crate) sent: BTreeSet<String>,
    pub(crate) duplicate_sends: u64,
    /// `None` when the queue does not say (SQS drops a duplicate silently).
    pub dropped_by_dedup: Option<u64>,
    /// Malformed observations sent: each must end in the dead-letter queue.
    pub malformed: u64,
    /// Ids of the malformed messages: each must end in the dead-letter
    /// queue.
    pub(crate) poison: Vec<String>,
    /// Valid observations whose send met a transient error before it was
    /// accepted, by the id the queue finally gave: how the send went.
    /// A lost message found here points at the send, not the pipeline.
    pub(crate) retried_sends: BTreeMap<String, RetriedSend>,
}

/// A send the producer had to repeat (the database restarted under it).
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct RetriedSend {
    /// The transient errors of the failed attempts, in order.
    pub(crate) errors: Vec<String>,
    /// Whether the attempt that succeeded was answered as a duplicate:
    /// then an earlier attempt had committed though its client saw an
    /// error, and the id is that attempt's message.
    pub(crate) answered_as_duplicate: bool,
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

/// Sends every observation, each with a deduplication id, so a send
/// retried after a lost answer keeps one message.
async fn produce<Q: Queue>(
    queue: &Q,
    setup: &Setup,
    config: &IncidentRunConfig,
    retrier: &Retrier,
    reports_duplicates: bool,
) -> anyhow::Result<Produced> {
    let mut produced = Produced {
        dropped_by_dedup: reports_duplicates.then_some(0),
        ..Produced::default()
    };
    for i in 0..config.observations {
        let (m, twice) = {
            let mut rng = rand::rng();
            let (org, entity) = &setup.entities[rng.random_range(0..setup.entities.len())];
            let o = observation(&mut rng, *org, entity);
            let body = serde_json::to_string(&o)?;
            let twice = rng.random::<f64>() < config.duplicates;
            let m = SendMessage::new(body)
                .group(o.group())
                .dedup(format!("obs-{i}"));
            (m, twice)
        };
        let (sent, errors) = retrier
            .run_noting_errors("sending an observation", || queue.send(m.clone()))
            .await?;
        if !errors.is_empty() {
            produced.retried_sends.insert(
                sent.id.clone(),
                RetriedSend {
                    errors,
                    answered_as_duplicate: sent.duplicate,
                },
            );
        }
        produced.sent.insert(sent.id);
        if twice {
            // The producer retries a send it thinks failed: same
            // deduplication id, so the queue keeps one message.
            produced.duplicate_sends += 1;
            let again = retrier
                .run("sending an observation again", || queue.send(m.clone()))
                .await?;
            if let (true, Some(dropped)) = (again.duplicate, &mut produced.dropped_by_dedup) {
                *dropped += 1;
            }
        }
        if i % 10 == 9 {
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
        let m = SendMessage::new(body)
            .group(format!("poison-{i}"))
            .dedup(format!("poison-{i}"));
        let sent = retrier
            .run("sending a poison message", || queue.send(m.clone()))
            .await?;
        produced.poison.push(sent.id);
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
    retrier: Arc<Retrier>,
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
            // The pager retries (the key makes it one incident), as it
            // does after a connection error.
            for _ in 0..2 {
                retrier
                    .run("declaring", || service.declare(org, &d, "on-call"))
                    .await?;
            }
            actions += 1;
        }
        let filter = IncidentFilter {
            lifecycle: Some(Lifecycle::Open),
            limit: Some(5),
            ..Default::default()
        };
        let open = retrier
            .run("listing open incidents", || service.list(org, &filter))
            .await?;
        for (n, incident) in open.iter().enumerate() {
            let done = retrier
                .run("acknowledging or resolving", || async {
                    let done = if n % 2 == 0 {
                        service.resolve(org, incident.id, "on-call").await
                    } else {
                        service.acknowledge(org, incident.id, "on-call").await
                    };
                    match done {
                        Ok(_) => Ok(true),
                        // The pipeline or another person got there first
                        // (or our own attempt whose answer was lost).
                        Err(pgonce_incidents::Error::InvalidTransition { .. }) => Ok(false),
                        Err(e) => Err(e),
                    }
                })
                .await?;
            if done {
                actions += 1;
            }
        }
        if tick.is_multiple_of(10) {
            let external = format!("svc-{}", (tick as usize / 10) * 2 % entities);
            let entity = retrier
                .run("finding an entity", || async {
                    match store::find_entity(service.pool(), org, &external).await {
                        Ok(e) => Ok(Some(e)),
                        Err(pgonce_incidents::Error::NotFound { .. }) => Ok(None),
                        Err(e) => Err(e),
                    }
                })
                .await?;
            if let Some(entity) = entity {
                retrier
                    .run("turning a singleton off", || {
                        store::set_entity_singleton(service.pool(), org, entity.id, false)
                    })
                    .await?;
            }
        }
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    Ok(actions)
}

fn snapshot_sum(counters: &[Arc<PipelineCounters>]) -> PipelineSnapshot {
    let mut total = PipelineSnapshot::default();
    for c in counters {
        total += c.snapshot();
    }
    total
}

/// A notification job, as the audit after the run saw it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct NotificationJob {
    /// The job's id in `pgonce.jobs`.
    pub job_id: i64,
    /// The incident whose notification it delivers.
    pub incident_id: i64,
    /// Its status: `pending`, `processing`, `failed`, `completed` or `dead`.
    pub status: String,
    /// Attempts made so far.
    pub attempts: i32,
    /// Attempts allowed before it is dead.
    pub max_attempts: i32,
    /// The error of its last failed attempt.
    pub last_error: Option<String>,
    /// Seconds until it may run again (negative: overdue).
    pub run_in_secs: Option<f64>,
    /// Seconds left on its lease, while claimed.
    pub lease_left_secs: Option<f64>,
}

impl NotificationJob {
    /// `completed` or `dead`: it never changes again.
    pub(crate) fn terminal(&self) -> bool {
        matches!(self.status.as_str(), "completed" | "dead")
    }

    /// Why it is not done yet, in words.
    pub(crate) fn why_pending(&self) -> String {
        let tried = format!("{} of {} attempts failed", self.attempts, self.max_attempts);
        let error = self
            .last_error
            .as_deref()
            .map(|e| format!("; last error: {e}"))
            .unwrap_or_default();
        match self.status.as_str() {
            "processing" => format!(
                "claimed, lease ends in {:.1} s (a notifier that died holds it until then); {tried}{error}",
                self.lease_left_secs.unwrap_or(0.0)
            ),
            "failed" => format!(
                "waiting for its retry in {:.1} s (backoff), then the re-driver; {tried}{error}",
                self.run_in_secs.unwrap_or(0.0)
            ),
            "pending" => format!(
                "runnable in {:.1} s, not yet claimed by a notifier; {tried}{error}",
                self.run_in_secs.unwrap_or(0.0).max(0.0)
            ),
            other => format!("{other}; {tried}{error}"),
        }
    }
}

/// A valid observation the pipeline did not process, as the audit saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct UnprocessedMessage {
    pub(crate) message_id: String,
    /// The queue it is in now; `None`: deleted unprocessed (lost).
    pub(crate) queue: Option<String>,
    pub(crate) receive_count: Option<i32>,
    /// Received and its visibility timeout not over yet.
    pub(crate) in_flight: Option<bool>,
}

/// I3, split by what went wrong.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NotificationAudit {
    /// A violation: two `notifications` rows, or two jobs, or two completed.
    pub more_than_once: Vec<NotNotifiedOnce>,
    /// A violation: no job was ever enqueued, or the job is dead (it ran
    /// out of attempts), or completed without its record.
    pub never_enqueued_or_lost: Vec<(NotNotifiedOnce, Option<NotificationJob>)>,
    /// Not a violation yet, and not a success: still waiting (lease, backoff,
    /// claim) when the deadline ran out.
    pub pending_at_deadline: Vec<NotificationJob>,
}

impl NotificationAudit {
    /// I3 holds: no notification sent more than once, lost, or still
    /// pending.
    pub fn holds(&self) -> bool {
        self.more_than_once.is_empty()
            && self.never_enqueued_or_lost.is_empty()
            && self.pending_at_deadline.is_empty()
    }

    /// Splits what [`invariants::not_notified_once`] found, given every
    /// notification job of the run's incidents.
    pub fn classify(not_once: Vec<NotNotifiedOnce>, jobs: &[NotificationJob]) -> NotificationAudit {
        let mut by_incident: BTreeMap<i64, Vec<&NotificationJob>> = BTreeMap::new();
        for j in jobs {
            by_incident.entry(j.incident_id).or_default().push(j);
        }
        let mut audit = NotificationAudit::default();
        for n in not_once {
            let its = by_incident.remove(&n.incident_id).unwrap_or_default();
            if n.notifications > 1 || n.jobs > 1 || n.completed_jobs > 1 {
                audit.more_than_once.push(n);
            } else if let Some(pending) = its.iter().find(|j| !j.terminal()) {
                audit.pending_at_deadline.push((*pending).clone());
            } else {
                audit
                    .never_enqueued_or_lost
                    .push((n, its.first().map(|j| (*j).clone())));
            }
        }
        audit
    }
}

/// I6, split by what went wrong.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ObservationAudit {
    /// A violation: deleted without being processed, or dead-lettered
    /// though valid.
    pub(crate) lost: Vec<UnprocessedMessage>,
    /// Still in the queue (visible or in flight) when the deadline ran out.
    pub(crate) pending_at_deadline: Vec<UnprocessedMessage>,
    /// Malformed messages sent.
    pub(crate) malformed_sent: u64,
    /// How many of them reached the dead-letter queue (all must).
    pub malformed_dead_lettered: u64,
    /// How many of them were still in the observations queue when the
    /// deadline ran out, receives to go before they are dead-lettered:
    /// unfinished, not lost.
    pub malformed_pending: u64,
    /// Messages in the dead-letter queue, all told: the malformed ones,
    /// and valid ones delivered more than the queue allows though processed
    /// (a slow machine), which is no loss.
    pub(crate) dead_lettered: u64,
}

impl ObservationAudit {
    /// Malformed messages in neither queue: deleted, never dead-lettered.
    pub(crate) fn malformed_vanished(&self) -> u64 {
        self.malformed_sent
            .saturating_sub(self.malformed_dead_lettered + self.malformed_pending)
    }

    /// Nothing lost, nothing pending, every malformed message dead-lettered.
    pub(crate) fn holds(&self) -> bool {
        self.lost.is_empty()
            && self.pending_at_deadline.is_empty()
            && self.malformed_dead_lettered == self.malformed_sent
    }
}

/// The database restart a run was asked for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RestartOutcome {
    /// Seconds into the run it was asked for.
    pub(crate) at_secs: f64,
    /// Seconds the restart took (stop, start, ready).
    pub(crate) took_secs: f64,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// What an incident run did and found.
#[derive(Debug, Clone)]
pub struct IncidentRunOutcome {
    /// The queue the run used: `postgres` or `sqs`.
    pub backend: &'static str,
    /// What the producer sent.
    pub produced: Produced,
    /// The pipeline's counters, summed over every runtime the run started.
    pub pipeline: PipelineSnapshot,
    /// The background workers' counters.
    pub workers: WorkerCounters,
    /// Declarations, acknowledgements and resolutions made by hand while the
    /// pipeline ran.
    pub human_actions: u64,
    /// The run's organizations' totals, read from the database at the end.
    pub tallies: Tallies,
    pub(crate) invariants: InvariantReport,
    /// I3's audit of the notification jobs.
    pub notifications: NotificationAudit,
    /// I6's audit of the observations queue.
    pub observations: ObservationAudit,
    /// What the webhook receiver saw.
    pub receiver: ReceiverStats,
    /// I3's audit of the receiver's log: each incident's notification
    /// accepted once.
    pub deliveries: DeliveryAudit,
    pub(crate) queue: QueueStats,
    /// Every message processed and none left in the queue, with no stall
    /// as long as the drain deadline on the way (the notifications are the
    /// settle's).
    pub drained: bool,
    pub(crate) drain_deadline: Duration,
    /// The bound of the wait for notification jobs after the drain: how
    /// long it may go without any of them moving.
    pub(crate) settle_bound: Duration,
    /// Every notification job terminal, never `settle_bound` without one
    /// moving.
    pub settled: bool,
    /// The database restart, when the run had one.
    pub restart: Option<RestartOutcome>,
    /// Database calls of the run's drivers retried after a transient error.
    pub driver_retries: u64,
    /// Wall time of the whole run, settle phase included.
    pub elapsed: Duration,
}

impl IncidentRunOutcome {
    /// I1, I2, I3 (in the database and in the receiver's log, no
    /// notification pending either) and I6 (nothing pending, malformed
    /// messages dead-lettered) all hold.
    pub fn all_hold(&self) -> bool {
        self.invariants.i1()
            && self.invariants.i2()
            && self.notifications.holds()
            && self.invariants.i3()
            && self.deliveries.holds()
            && self.observations.holds()
            && self.invariants.i6()
    }
}

/// Every notification job of the incidents of `organizations`.
async fn notification_jobs(
    pool: &PgPool,
    organizations: &[i64],
) -> sqlx::Result<Vec<NotificationJob>> {
    sqlx::query_as(include_str!("incident_run/sql/notification_jobs.sql"))
        .bind(NOTIFY_JOB_KIND)
        .bind(organizations)
        .fetch_all(pool)
        .await
}

/// Every incident of `organizations`: each must be notified once.
async fn incident_ids(pool: &PgPool, organizations: &[i64]) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar(include_str!("incident_run/sql/incident_ids.sql"))
        .bind(organizations)
        .fetch_all(pool)
        .await
}

/// What counts as notification jobs moving while [`settle`] waits: one
/// becoming terminal, or one making another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SettleProgress {
    terminal: usize,
    attempts: i64,
}

impl SettleProgress {
    fn of(jobs: &[NotificationJob]) -> SettleProgress {
        SettleProgress {
            terminal: jobs.iter().filter(|j| j.terminal()).count(),
            attempts: jobs.iter().map(|j| i64::from(j.attempts)).sum(),
        }
    }
}

impl Progress for SettleProgress {
    fn best(self, other: SettleProgress) -> SettleProgress {
        SettleProgress {
            terminal: self.terminal.max(other.terminal),
            attempts: self.attempts.max(other.attempts),
        }
    }
}

/// What [`settle`] saw.
#[derive(Debug, Clone)]
pub struct Settled {
    /// How long it was allowed to wait without a job moving
    /// ([`settle_bound`]).
    pub(crate) bound: Duration,
    /// Every notification job terminal, never `bound` without one moving.
    pub settled: bool,
    /// The jobs when it stopped waiting.
    pub jobs: Vec<NotificationJob>,
}

/// Waits until every notification job of `organizations` is terminal,
/// giving up only after `settle_bound` without any of them becoming
/// terminal or making an attempt, running what finishes them: a notifier alone
/// does not. A failed job needs the re-driver to become runnable once its
/// backoff is over, a job claimed by a notifier that stopped needs the
/// reaper once its lease has run out; so this runs all three, as a runtime
/// with no pipeline workers (`runtime` must name a notifier).
pub async fn settle<Q: Queue + Clone + 'static>(
    service: &Service,
    queue: &Q,
    runtime: &RuntimeConfig,
    organizations: &[i64],
    retrier: &Retrier,
) -> anyhow::Result<Settled> {
    let notifier = runtime
        .notifier
        .as_ref()
        .context("settling notifications needs a notifier configuration")?;
    let pool = service.pool();
    let started = Instant::now();
    let jobs = retrier
        .run("auditing notification jobs", || {
            notification_jobs(pool, organizations)
        })
        .await?;
    // The most attempts any unfinished job has left.
    let attempts = jobs
        .iter()
        .filter(|j| !j.terminal())
        .map(|j| (j.max_attempts - j.attempts).max(1) as u32)
        .max()
        .unwrap_or(1);
    let bound = settle_bound(notifier, runtime, attempts);
    let mut config = runtime.clone();
    config.workers = 0;
    config.job_maintenance = true;
    let settler = Runtime::start(service, queue.clone(), config)?;
    // The bound is how long the jobs may go without moving, not how long
    // they may take: on a slow machine each attempt takes longer, and a
    // verdict must not depend on that.
    let mut watch = StallWatch::new(bound, started);
    watch.saw(SettleProgress::of(&jobs), started);
    let (settled, jobs) = loop {
        let jobs = retrier
            .run("auditing notification jobs", || {
                notification_jobs(pool, organizations)
            })
            .await?;
        if jobs.iter().all(NotificationJob::terminal) {
            break (true, jobs);
        }
        let now = Instant::now();
        watch.saw(SettleProgress::of(&jobs), now);
        if watch.stalled(now) {
            break (false, jobs);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    settler.shutdown().await?;
    Ok(Settled {
        bound,
        settled,
        jobs,
    })
}

/// How often the drain loop reads the queue's counts while messages are
/// still being processed.
const STATS_EVERY: Duration = Duration::from_secs(5);

/// What the drain loop counts as progress: the pipeline's work only. Not
/// notifications: the people keep declaring incidents while the drain
/// runs, so notifications keep being sent, which would look like progress
/// for ever, even with one notification that never will be (a drain that
/// waited for it ran until the test's own timeout). They are the settle's
/// to wait for, once the people have stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DrainProgress {
    /// Deliveries the pipeline finished (first and repeated).
    deliveries: i64,
    /// Messages in the dead-letter queue.
    dead_lettered: u64,
    /// Messages left in the queue, visible or in flight.
    left: u64,
}

impl Progress for DrainProgress {
    fn best(self, other: DrainProgress) -> DrainProgress {
        DrainProgress {
            deliveries: self.deliveries.max(other.deliveries),
            dead_lettered: self.dead_lettered.max(other.dead_lettered),
            left: self.left.min(other.left),
        }
    }
}

/// Counts a wait can watch move: [`Progress::best`] keeps, of two readings,
/// the furthest each count has gone.
trait Progress: Copy + Eq {
    fn best(self, other: Self) -> Self;
}

/// Tells a slow wait from a stuck one: stalled once `window` went by with
/// no count past its best (for the drain: more deliveries or dead letters,
/// fewer messages left; for the settle: more jobs terminal
/// or more attempts). A deadline counted from the start failed the demo's
/// verdict on a loaded machine while every invariant held and the pipeline
/// still moved.
#[derive(Debug)]
struct StallWatch<P> {
    window: Duration,
    best: Option<P>,
    last: Instant,
}

impl<P: Progress> StallWatch<P> {
    fn new(window: Duration, at: Instant) -> StallWatch<P> {
        StallWatch {
            window,
            best: None,
            last: at,
        }
    }

    fn saw(&mut self, now: P, at: Instant) {
        let best = self.best.map_or(now, |b| b.best(now));
        if self.best != Some(best) {
            self.best = Some(best);
            self.last = at;
        }
    }

    fn stalled(&self, at: Instant) -> bool {
        at.duration_since(self.last) >= self.window
    }
}

/// Runs the incident run on `pool` (a migrated, empty scratch database),
/// its observations on the PostgreSQL queue in the same database.
/// `restart`: restart the server this many seconds after production
/// starts. `progress`: a bar to move, for people watching.
pub async fn run(
    pool: &PgPool,
    config: &IncidentRunConfig,
    restart: Option<(Duration, Restarter)>,
    progress: Option<&ProgressBar>,
) -> anyhow::Result<IncidentRunOutcome> {
    pgonce_incidents::migrate(pool)
        .await
        .context("applying the service's migrations")?;
    let queue_options = PgQueueOptions {
        listen: config.listen.clone(),
        ..PgQueueOptions::default()
    };
    let queue = observations_queue_with(
        pool,
        config.visibility,
        config.max_receive_count,
        queue_options,
    )
    .await?;
    let audit = PgAudit {
        dead_letter_queue: OBSERVATIONS_DEAD_LETTERS.to_owned(),
    };
    run_on(pool, config, queue, audit, restart, progress).await
}

/// [`run`] on any observations queue (`queue`, created with
/// `config.visibility` and `config.max_receive_count`, and empty), with
/// `audit` to find its messages afterwards: the PostgreSQL queue or SQS.
/// The faults are the same on both; what keeps each invariant where SQS
/// is weaker is said in `pgonce demo`'s report.
pub async fn run_on<Q, A>(
    pool: &PgPool,
    config: &IncidentRunConfig,
    queue: Q,
    audit: A,
    restart: Option<(Duration, Restarter)>,
    progress: Option<&ProgressBar>,
) -> anyhow::Result<IncidentRunOutcome>
where
    Q: Queue + Clone + 'static,
    A: QueueAudit,
{
    config.validate()?;
    let started = Instant::now();
    // Long enough for a restart under load; a server gone for good fails
    // the run after it.
    let retrier = Arc::new(Retrier::new(Duration::from_secs(60)));
    let say = |line: String| match progress {
        Some(bar) => bar.println(line),
        None => tracing::info!("{line}"),
    };
    pgonce_incidents::migrate(pool)
        .await
        .context("applying the service's migrations")?;
    store::set_rollout_percent(pool, config.rollout).await?;
    let service = Service::new(
        pool.clone(),
        ServiceConfig {
            notify_max_attempts: config.notify_max_attempts,
            ..ServiceConfig::default()
        },
    )?;
    let setup = set_up(pool, config).await?;
    let receiver = WebhookReceiver::start(config.receiver).await?;

    // Two worker runtimes (each what one `pgonce worker` process runs, in
    // this process); the second also runs the notifier, and is killed
    // part-way: dropping a Runtime aborts its tasks where they stand, with
    // no ack, heartbeat or completion, as a killed process would.
    let first = Runtime::start(
        &service,
        queue.clone(),
        config.runtime_config(receiver.url(), false),
    )?;
    let second = Runtime::start(
        &service,
        queue.clone(),
        config.runtime_config(receiver.url(), true),
    )?;
    let mut counters = vec![first.pipeline(), second.pipeline()];
    let (stop_people, people_stop) = tokio::sync::watch::channel(!config.people);
    let people = tokio::spawn(people(
        service.clone(),
        setup.organizations.clone(),
        config.entities,
        people_stop,
        retrier.clone(),
    ));
    let restart = restart.map(|(at, restarter)| {
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            let began = Instant::now();
            let done = tokio::task::spawn_blocking(restarter).await;
            let error = match done {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("{e:#}")),
                Err(e) => Some(format!("the restart panicked: {e}")),
            };
            RestartOutcome {
                at_secs: at.as_secs_f64(),
                took_secs: began.elapsed().as_secs_f64(),
                error,
            }
        })
    });

    let produced = produce(&queue, &setup, config, &retrier, audit.reports_duplicates()).await?;
    let expected = produced.sent.len() as u64;
    if let Some(bar) = progress {
        bar.set_length(expected);
    }
    let mut second = Some(second);
    let mut replacement = None;
    let mut drained = false;
    // Given up only after `drain_deadline` without progress: a slow machine
    // drains later, a stuck pipeline still ends the run.
    let mut watch = StallWatch::new(config.drain_deadline, Instant::now());
    let mut stats_read: Option<(Instant, QueueStats)> = None;
    while !watch.stalled(Instant::now()) {
        let tallies = retrier
            .run("counting", || {
                invariants::tallies(pool, &setup.organizations)
            })
            .await?;
        let done = tallies.messages_processed as u64;
        if let Some(bar) = progress {
            bar.set_position(done);
            let seen = snapshot_sum(&counters);
            bar.set_message(format!(
                "{} incidents, {} redeliveries, {} conflicts",
                tallies.incidents, seen.redeliveries, seen.conflicts
            ));
        }
        if second.is_some() && done as f64 >= expected as f64 * config.kill_after {
            // Kill a worker runtime mid-flight, notifier included; start a
            // replacement as an orchestrator would.
            drop(second.take());
            say("demo: killed worker runtime 2 (its messages and claimed notifications must come back)".into());
            let r = Runtime::start(
                &service,
                queue.clone(),
                config.runtime_config(receiver.url(), true),
            )?;
            counters.push(r.pipeline());
            replacement = Some(r);
        }
        // The queue's counts, read at every pass once every message was
        // processed (to see the queue empty) and every few seconds before,
        // for the stall watch only: on SQS a read is two more calls to the
        // server the pipeline receives from, which a local moto serves
        // one at a time.
        let stats = match stats_read.take() {
            Some((at, stats)) if done < expected && at.elapsed() < STATS_EVERY => (at, stats),
            _ => (
                Instant::now(),
                retrier.run("queue stats", || queue.stats()).await?,
            ),
        };
        let stats = &stats_read.insert(stats).1;
        let queue_done = done >= expected && stats.depth == 0 && stats.in_flight == 0;
        watch.saw(
            DrainProgress {
                deliveries: tallies.deliveries_processed,
                dead_lettered: stats.dead_letter_depth.unwrap_or(0),
                left: stats.depth + stats.in_flight,
            },
            Instant::now(),
        );
        if queue_done {
            // Every message processed and none left: the notifications
            // still under way are the settle's, below.
            drained = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = stop_people.send(true);
    let human_actions = people.await.context("people task")??;
    let restart = match restart {
        Some(task) => Some(task.await.context("restart task")?),
        None => None,
    };
    let mut workers = first.shutdown().await?.workers;
    if let Some(r) = replacement {
        workers += r.shutdown().await?.workers;
    }
    drop(second);

    // Settle: the people may have opened incidents after the pipeline
    // finished, and the runtimes just stopped may have left notifications
    // claimed (a notifier stopped mid-send) or failed, waiting for retry.
    let settled = settle(
        &service,
        &queue,
        &config.runtime_config(receiver.url(), true),
        &setup.organizations,
        &retrier,
    )
    .await?;
    let (bound, settled) = (settled.bound, settled.settled);

    let sent: Vec<String> = produced.sent.iter().cloned().collect();
    let checked = retrier
        .run("checking the invariants", || {
            invariants::check(pool, &setup.organizations, &sent)
        })
        .await?;
    let tallies = retrier
        .run("counting", || {
            invariants::tallies(pool, &setup.organizations)
        })
        .await?;
    let queue_stats = retrier.run("queue stats", || queue.stats()).await?;
    let jobs = retrier
        .run("auditing notification jobs", || {
            notification_jobs(pool, &setup.organizations)
        })
        .await?;
    let notifications = NotificationAudit::classify(checked.i3_not_notified_once.clone(), &jobs);
    let opened = retrier
        .run("listing the run's incidents", || {
            incident_ids(pool, &setup.organizations)
        })
        .await?;
    let unfinished: BTreeSet<i64> = jobs
        .iter()
        .filter(|j| !j.terminal())
        .map(|j| j.incident_id)
        .collect();
    let deliveries = DeliveryAudit::of(&opened, &unfinished, &receiver.accepted());
    let unprocessed = retrier
        .run("auditing unprocessed messages", || {
            audit.locate(pool, &checked.i6_unprocessed)
        })
        .await?;
    let poison = retrier
        .run("auditing malformed messages", || {
            audit.locate(pool, &produced.poison)
        })
        .await?;
    let dead_letters = audit.dead_letter_queue();
    let poison_in = |name: &str| {
        poison
            .iter()
            .filter(|m| m.queue.as_deref() == Some(name))
            .count() as u64
    };
    let mut observations = ObservationAudit {
        malformed_dead_lettered: poison_in(dead_letters),
        malformed_pending: poison_in(queue.name()),
        malformed_sent: produced.malformed,
        dead_lettered: queue_stats.dead_letter_depth.unwrap_or(0),
        ..ObservationAudit::default()
    };
    for m in unprocessed {
        if m.queue.as_deref() == Some(queue.name()) {
            observations.pending_at_deadline.push(m);
        } else {
            debug_assert!(m.queue.is_none() || m.queue.as_deref() == Some(dead_letters));
            observations.lost.push(m);
        }
    }
    let outcome = IncidentRunOutcome {
        backend: audit.backend(),
        produced,
        pipeline: snapshot_sum(&counters),
        workers,
        human_actions,
        tallies,
        invariants: checked,
        notifications,
        observations,
        receiver: receiver.stats(),
        deliveries,
        queue: queue_stats,
        drained,
        drain_deadline: config.drain_deadline,
        settle_bound: bound,
        settled,
        restart,
        driver_retries: retrier.retried(),
        elapsed: started.elapsed(),
    };
    Ok(outcome)
}

/// Waits until the pipeline has processed `expected` observations of
/// `organizations` (counted in the database, so a redelivered message
/// counts once), or until it went `stall_window` without processing any
/// delivery; returns how many it processed. What `pgonce bench service`
/// drains its backlog with; the run above drains the same way, with a
/// runtime killed and notifications checked on the way.
pub(crate) async fn drain(
    pool: &PgPool,
    organizations: &[i64],
    expected: u64,
    stall_window: Duration,
    retrier: &Retrier,
) -> anyhow::Result<u64> {
    drain_counted(expected, stall_window, || {
        retrier.run("counting", || invariants::tallies(pool, organizations))
    })
    .await
}

/// [`drain`], its tallies read by `count`.
async fn drain_counted<F, Fut>(
    expected: u64,
    stall_window: Duration,
    mut count: F,
) -> anyhow::Result<u64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Tallies>>,
{
    let mut watch = StallWatch::new(stall_window, Instant::now());
    loop {
        let tallies = count().await?;
        let done = tallies.messages_processed as u64;
        let now = Instant::now();
        watch.saw(
            DrainProgress {
                deliveries: tallies.deliveries_processed,
                dead_lettered: 0,
                left: expected.saturating_sub(done),
            },
            now,
        );
        if done >= expected || watch.stalled(now) {
            return Ok(done);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait that keeps moving is never stalled, however long it runs; one
    /// that stops is stalled a window after its last move, and a count
    /// going back (a message returning to the queue) is not a move.
    #[test]
    fn a_wait_is_stalled_only_a_window_after_its_last_move() {
        let window = Duration::from_secs(10);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let reading = |terminal, attempts| SettleProgress { terminal, attempts };
        let mut watch = StallWatch::new(window, t0);
        watch.saw(reading(0, 1), at(0));
        for s in 1..100 {
            watch.saw(reading(0, 1 + s as i64), at(s * 9));
            assert!(!watch.stalled(at(s * 9 + 9)), "moving at {} s", s * 9);
        }
        assert!(watch.stalled(at(99 * 9 + 10)));
        let mut drain = StallWatch::new(window, t0);
        let left = |left| DrainProgress {
            deliveries: 5,
            dead_lettered: 0,
            left,
        };
        drain.saw(left(3), at(0));
        drain.saw(left(4), at(5));
        assert!(drain.stalled(at(10)), "more left is not progress");
        drain.saw(left(2), at(11));
        assert!(!drain.stalled(at(20)));
    }

    /// A backlog that takes longer than the window to drain, processing a
    /// message at every count (at least 50 ms apart: 100 of them take 5 s
    /// against a window of 2 s), drains all of it: the window bounds a
    /// stall, not the drain. It ended at the window counted from the start.
    #[tokio::test]
    async fn a_drain_slower_than_its_window_ends_when_done() {
        let mut processed = 0;
        let done = drain_counted(100, Duration::from_secs(2), || {
            processed += 1;
            let tallies = Tallies {
                messages_processed: processed,
                deliveries_processed: processed,
                ..Tallies::default()
            };
            async move { Ok(tallies) }
        })
        .await
        .unwrap();
        assert_eq!(done, 100);
    }

    /// One that stops moving ends a window after its last move.
    #[tokio::test]
    async fn a_drain_that_stops_moving_ends_a_window_later() {
        let mut counts = 0;
        let started = Instant::now();
        let done = drain_counted(100, Duration::from_millis(300), || {
            counts += 1;
            let tallies = Tallies {
                messages_processed: counts.min(5),
                deliveries_processed: counts.min(5),
                ..Tallies::default()
            };
            async move { Ok(tallies) }
        })
        .await
        .unwrap();
        assert_eq!(done, 5);
        assert!(started.elapsed() >= Duration::from_millis(300));
    }
}
