//! The pipeline, where a redelivered observation must not open a duplicate
//! incident: observations arrive on a FIFO queue grouped by entity; a
//! [`pgonce::Worker`] runs an [`ObservationHandler`] for each.
//!
//! Per message: unless the ledger shows the observation processed before
//! (then its delivery is counted and nothing else done), record the
//! entity's latest attributes, read what each policy's decision depends on
//! (short reads, connection returned), evaluate every policy with the
//! [`Evaluator`] (slow, no connection held), and open an incident for each
//! violation through [`Service::open_from_pipeline`], on the guarded path
//! or, for entities outside the rollout, the plain one.
//!
//! The queue delivers at least once: a visibility timeout shorter than the
//! evaluation hands the same message to a second worker while the first is
//! still busy. On the guarded path the second decision was made on the same
//! state as the first, so its write finds the set changed and gets a
//! conflict: counted, logged at WARN, message acked. The entity's next
//! observation re-evaluates from fresh state.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pgonce::{Handler, HandlerError, Received};
use rand::Rng;

use crate::error::{Error, Result};
use crate::model::{Entity, Observation, Policy};
use crate::service::{Decision, Service, WritePath};
use crate::store;

/// Decides whether an observation violates a policy. Implementations may be
/// slow (remote calls, model calls): nothing is held while they run.
pub trait Evaluator: Send + Sync + 'static {
    /// Whether `observation` of `entity` violates `policy`. An error is an
    /// evaluation failure: the pipeline counts it and leaves the message on the
    /// queue, so its redelivery evaluates again.
    fn evaluate(
        &self,
        policy: &Policy,
        entity: &Entity,
        observation: &Observation,
    ) -> impl Future<Output = std::result::Result<bool, HandlerError>> + Send;
}

/// Settings of the [`SimulatedEvaluator`].
#[derive(Debug, Clone, PartialEq)]
pub struct SimulatedEvaluatorConfig {
    /// Least time one evaluation takes. Default 200 ms.
    pub latency: Duration,
    /// Extra time, uniform in [0, jitter). Default 100 ms.
    pub jitter: Duration,
    /// Share of evaluations that fail (a remote call erroring), in [0, 1].
    /// Default 0.
    pub failure_rate: f64,
    /// Share of evaluations that hit a slow remote (the tail that outlives
    /// a visibility timeout), in [0, 1]. Default 0.
    pub slow_rate: f64,
    /// How long a slow evaluation takes instead. Default 1 s.
    pub slow_latency: Duration,
}

impl Default for SimulatedEvaluatorConfig {
    fn default() -> Self {
        SimulatedEvaluatorConfig {
            latency: Duration::from_millis(200),
            jitter: Duration::from_millis(100),
            failure_rate: 0.0,
            slow_rate: 0.0,
            slow_latency: Duration::from_secs(1),
        }
    }
}

/// The default evaluator: applies the policy's [`Rule`](crate::model::Rule)
/// after a simulated remote call of configurable latency and failure rate.
#[derive(Debug, Clone)]
pub struct SimulatedEvaluator {
    config: SimulatedEvaluatorConfig,
}

impl SimulatedEvaluator {
    /// An evaluator with `config`; [`Error::Invalid`] if a rate is outside
    /// 0 to 1.
    pub fn new(config: SimulatedEvaluatorConfig) -> Result<SimulatedEvaluator> {
        for rate in [config.failure_rate, config.slow_rate] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(Error::invalid("evaluator rate", "must be in [0, 1]"));
            }
        }
        Ok(SimulatedEvaluator { config })
    }
}

impl Evaluator for SimulatedEvaluator {
    async fn evaluate(
        &self,
        policy: &Policy,
        _entity: &Entity,
        observation: &Observation,
    ) -> std::result::Result<bool, HandlerError> {
        let (took, fail) = {
            let c = &self.config;
            let mut rng = rand::rng();
            let took = if rng.random::<f64>() < c.slow_rate {
                c.slow_latency
            } else {
                c.latency + c.jitter.mul_f64(rng.random::<f64>())
            };
            (took, rng.random::<f64>() < c.failure_rate)
        };
        tokio::time::sleep(took).await;
        if fail {
            return Err("simulated evaluation failure".into());
        }
        Ok(policy.rule.violated_by(&observation.attributes))
    }
}

/// Whether `entity_id` takes the guarded path at `percent` rollout:
/// deterministic per entity, so an entity does not flip between paths from
/// one message to the next, and raising the percentage only adds entities.
pub fn on_guarded_path(entity_id: i64, percent: u8) -> bool {
    // Fibonacci hashing spreads consecutive ids over the 100 buckets.
    let bucket = ((entity_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % 100;
    bucket < u64::from(percent)
}

/// What the pipeline did, summed over every message handled.
#[derive(Debug, Default)]
pub struct PipelineCounters {
    /// Deliveries handled, redeliveries included.
    pub messages: AtomicU64,
    /// Deliveries after the first of a message.
    pub redeliveries: AtomicU64,
    /// Incidents opened, on either write path.
    pub incidents_opened: AtomicU64,
    /// Guarded writes refused because the state changed since the decision.
    pub conflicts: AtomicU64,
    /// Violations with an incident already open (singleton) or already
    /// opened by an earlier delivery of the message.
    pub already_open: AtomicU64,
    /// Deliveries whose evaluation failed and were left on the queue.
    pub evaluation_failures: AtomicU64,
    /// Deliveries refused as malformed: a body that is not an observation, or
    /// an organization that does not exist.
    pub malformed: AtomicU64,
    /// Incidents opened on the guarded path ([`WritePath::Guarded`]).
    pub guarded_writes: AtomicU64,
    /// Incidents opened on the plain path ([`WritePath::Plain`]).
    pub plain_writes: AtomicU64,
}

/// A plain copy of [`PipelineCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PipelineSnapshot {
    /// As [`PipelineCounters::messages`].
    pub messages: u64,
    /// As [`PipelineCounters::redeliveries`].
    pub redeliveries: u64,
    /// As [`PipelineCounters::incidents_opened`].
    pub incidents_opened: u64,
    /// As [`PipelineCounters::conflicts`].
    pub conflicts: u64,
    /// As [`PipelineCounters::already_open`].
    pub already_open: u64,
    /// As [`PipelineCounters::evaluation_failures`].
    pub evaluation_failures: u64,
    /// As [`PipelineCounters::malformed`].
    pub malformed: u64,
    /// As [`PipelineCounters::guarded_writes`].
    pub guarded_writes: u64,
    /// As [`PipelineCounters::plain_writes`].
    pub plain_writes: u64,
}

impl std::ops::AddAssign for PipelineSnapshot {
    /// Sums the counters of several handlers (processes).
    fn add_assign(&mut self, o: PipelineSnapshot) {
        self.messages += o.messages;
        self.redeliveries += o.redeliveries;
        self.incidents_opened += o.incidents_opened;
        self.conflicts += o.conflicts;
        self.already_open += o.already_open;
        self.evaluation_failures += o.evaluation_failures;
        self.malformed += o.malformed;
        self.guarded_writes += o.guarded_writes;
        self.plain_writes += o.plain_writes;
    }
}

impl PipelineCounters {
    /// The counters' current values. Each is read on its own (relaxed), so a
    /// snapshot taken while messages are handled need not be consistent across
    /// counters.
    pub fn snapshot(&self) -> PipelineSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PipelineSnapshot {
            messages: get(&self.messages),
            redeliveries: get(&self.redeliveries),
            incidents_opened: get(&self.incidents_opened),
            conflicts: get(&self.conflicts),
            already_open: get(&self.already_open),
            evaluation_failures: get(&self.evaluation_failures),
            malformed: get(&self.malformed),
            guarded_writes: get(&self.guarded_writes),
            plain_writes: get(&self.plain_writes),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The queue handler of the pipeline. Cheap to clone (shares counters and
/// the evaluator, which need not be `Clone` itself).
pub struct ObservationHandler<E> {
    service: Service,
    evaluator: Arc<E>,
    counters: Arc<PipelineCounters>,
}

// By hand: a derive would ask `E: Clone`, though only the Arc is cloned.
impl<E> Clone for ObservationHandler<E> {
    fn clone(&self) -> Self {
        ObservationHandler {
            service: self.service.clone(),
            evaluator: self.evaluator.clone(),
            counters: self.counters.clone(),
        }
    }
}

impl<E: Evaluator> ObservationHandler<E> {
    /// A handler that evaluates with `evaluator` and writes through `service`,
    /// with counters at zero.
    pub fn new(service: Service, evaluator: E) -> ObservationHandler<E> {
        ObservationHandler {
            service,
            evaluator: Arc::new(evaluator),
            counters: Arc::default(),
        }
    }

    /// The counters, shared with every clone of this handler.
    pub fn counters(&self) -> Arc<PipelineCounters> {
        self.counters.clone()
    }

    /// Handles one delivery; see the module docs. Errors leave the message
    /// on the queue (redelivered, dead-lettered after the queue's maximum
    /// receive count): a malformed body or an unknown organization, an
    /// evaluation failure, a database error.
    pub async fn process(&self, message: &Received) -> Result<()> {
        let c = &self.counters;
        bump(&c.messages);
        if message.receive_count > 1 {
            bump(&c.redeliveries);
            metrics::counter!("pgonce_incidents_redeliveries_total").increment(1);
        }
        let observation = Observation::parse(&message.body).inspect_err(|e| {
            bump(&c.malformed);
            tracing::warn!(message = %message.id, "malformed observation: {e}");
        })?;
        let message_id = &observation.ledger_key(&message.id);
        let pool = self.service.pool();
        let org = observation.organization_id;
        // An observation finished with before, sent again: applied once.
        // Its attributes are not recorded again (a newer observation of
        // the entity may have replaced them since) and its policies not
        // evaluated again; the delivery is counted on its ledger row.
        let resent = sqlx::query(include_str!("pipeline/sql/resend.sql"))
            .bind(org)
            .bind(message_id)
            .bind(&observation.entity)
            .execute(pool)
            .await?;
        if resent.rows_affected() > 0 {
            tracing::debug!(
                message = message_id,
                "observation processed before; counted"
            );
            metrics::counter!("pgonce_incidents_observations_total").increment(1);
            return Ok(());
        }
        let entity = store::upsert_entity(pool, org, &observation.entity, &observation.attributes)
            .await
            .inspect_err(|e| {
                if matches!(e, Error::NotFound { .. }) {
                    bump(&c.malformed);
                }
            })?;
        let policies = store::list_policies(pool, org).await?;
        let path = if on_guarded_path(entity.id, store::rollout_percent(pool).await?) {
            WritePath::Guarded
        } else {
            WritePath::Plain
        };

        // Short reads, one per policy; no connection kept.
        let mut seen = Vec::with_capacity(policies.len());
        for policy in &policies {
            seen.push(self.service.observe(policy, entity.id, message_id).await?);
        }
        // The slow part, every policy at once, holding nothing.
        let verdicts = futures::future::join_all(
            policies
                .iter()
                .map(|p| self.evaluator.evaluate(p, &entity, &observation)),
        )
        .await;

        let (mut opened, mut conflicts) = (0, 0);
        for ((policy, seen), verdict) in policies.iter().zip(&seen).zip(verdicts) {
            let violated = verdict.map_err(|e| {
                bump(&c.evaluation_failures);
                Error::Evaluation {
                    policy: policy.name.clone(),
                    why: e.to_string(),
                }
            })?;
            if !violated {
                continue;
            }
            if seen.decide() != Decision::Open {
                bump(&c.already_open);
                continue;
            }
            let title = format!("{} violated on {}", policy.name, entity.external_id);
            match self
                .service
                .open_from_pipeline(org, seen, &title, path)
                .await
            {
                Ok(incident) => {
                    opened += 1;
                    bump(&c.incidents_opened);
                    bump(match path {
                        WritePath::Guarded => &c.guarded_writes,
                        WritePath::Plain => &c.plain_writes,
                    });
                    tracing::debug!(number = incident.number, policy = %policy.name, entity = %entity.external_id, "incident opened");
                }
                // Already WARNed and counted by the guard; the next message
                // for this entity re-evaluates.
                Err(Error::Pgonce(pgonce::Error::Conflict { .. })) => {
                    conflicts += 1;
                    bump(&c.conflicts);
                    metrics::counter!("pgonce_incidents_pipeline_conflicts_total").increment(1);
                }
                Err(e) => return Err(e),
            }
        }
        sqlx::query(include_str!("pipeline/sql/record.sql"))
            .bind(message_id)
            .bind(org)
            .bind(entity.id)
            .bind(opened)
            .bind(conflicts)
            .execute(pool)
            .await?;
        metrics::counter!("pgonce_incidents_observations_total").increment(1);
        Ok(())
    }
}

/// The shortest retention [`LedgerCleanerConfig`] takes: twice the longest
/// any queue keeps a message (14 days, SQS's limit, on either backend), so
/// that a message can sit its whole retention in the observations queue
/// and then in its dead-letter queue, be moved back and be delivered, and
/// still find its ledger row.
pub const MIN_LEDGER_RETENTION: Duration = Duration::from_secs(2 * 14 * 24 * 3600);

/// The ledger's cleaner (`incidents.observations`, the rows by which a
/// redelivered observation is known as processed): what it deletes and how.
///
/// A ledger row is what makes a late delivery of an observation a repeat
/// rather than a new one. Once it is deleted, a delivery of that message
/// (a producer resending its `message_id`, a message redriven from a
/// dead-letter queue it sat in longer than the retention) is processed
/// again as new: its attributes recorded over newer ones, its policies
/// evaluated again (the guard still keeps a singleton policy at one open
/// incident). The retention is how late a resend may come and still be
/// caught; without a cleaner (the default) that is for ever, and the
/// ledger grows by a row per observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerCleanerConfig {
    /// Rows whose last delivery is older than this are deleted. At least
    /// [`MIN_LEDGER_RETENTION`].
    pub retention: Duration,
    /// Pause between passes.
    pub interval: Duration,
    /// Rows deleted per statement; at least 1.
    pub batch_size: i64,
}

impl LedgerCleanerConfig {
    /// What cannot work, as [`Error::Invalid`].
    pub fn validate(&self) -> Result<()> {
        if self.retention < MIN_LEDGER_RETENTION {
            return Err(Error::Invalid {
                what: "ledger retention",
                why: format!(
                    "at least 28 days (a message may sit 14 days in the observations queue \
                     and 14 more in its dead-letter queue), got {}",
                    humantime_serde::re::humantime::format_duration(self.retention)
                ),
            });
        }
        if self.retention > pgonce::maintenance::MAX_RETENTION {
            return Err(Error::Invalid {
                what: "ledger retention",
                why: format!(
                    "at most 1,000 years (leave the cleaner out to keep the ledger for good), \
                     got {}",
                    humantime_serde::re::humantime::format_duration(self.retention)
                ),
            });
        }
        pgonce::maintenance::MaintenanceConfig {
            interval: self.interval,
            batch_size: self.batch_size,
            ..pgonce::maintenance::MaintenanceConfig::keep_everything()
        }
        .validate()?;
        Ok(())
    }
}

/// One pass of the ledger's cleaner: deletes the rows past
/// `config.retention`, `config.batch_size` per statement (each a
/// transaction of its own), until a batch comes back short, and returns
/// how many it deleted. A row a delivery is updating is left to the next
/// pass; one a delivery updated meanwhile is kept (`forget.sql`).
pub async fn forget_processed(pool: &sqlx::PgPool, config: &LedgerCleanerConfig) -> Result<u64> {
    config.validate()?;
    let mut deleted = 0;
    loop {
        let n = sqlx::query(include_str!("pipeline/sql/forget.sql"))
            .bind(config.retention.as_secs_f64())
            .bind(config.batch_size)
            .execute(pool)
            .await?
            .rows_affected();
        deleted += n;
        metrics::counter!("pgonce_maintenance_deleted_total", "table" => "incidents_observations")
            .increment(n);
        if (n as i64) < config.batch_size {
            break;
        }
        tokio::task::yield_now().await;
    }
    if deleted > 0 {
        tracing::info!(
            deleted,
            "ledger cleaner deleted observations past retention"
        );
    }
    Ok(deleted)
}

impl<E: Evaluator> Handler for ObservationHandler<E> {
    async fn handle(&self, message: &Received) -> std::result::Result<(), HandlerError> {
        self.process(message).await.map_err(Into::into)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rollout_is_deterministic_and_only_grows() {
        for id in 0..1000 {
            assert!(!on_guarded_path(id, 0));
            assert!(on_guarded_path(id, 100));
            for p in 0..100 {
                if on_guarded_path(id, p) {
                    assert!(on_guarded_path(id, p + 1));
                }
            }
        }
        let half = (0..10_000).filter(|&id| on_guarded_path(id, 50)).count();
        assert!((4_500..5_500).contains(&half), "{half}");
    }
}
