//! The pipeline's parts against a real PostgreSQL: the plain path's
//! duplicate under redelivery, pluggable and failing evaluators, a late
//! resend under the producer's message id. The whole pipeline under faults
//! (duplicate sends, redeliveries, a killed worker, a database restart) is
//! the lab's incident run, tested in `pgonce-lab`'s `tests/pipeline.rs`.

use std::time::{Duration, Instant};

use pgonce::job::{ReaperConfig, RedriverConfig, RetryPolicy};
use pgonce::{Queue, SendMessage, WorkerConfig};
use pgonce_incidents::model::{Observation, Op, Rule, Singleton};
use pgonce_incidents::pipeline::{
    LedgerCleanerConfig, MIN_LEDGER_RETENTION, SimulatedEvaluatorConfig, forget_processed,
};
use pgonce_incidents::runtime::{Runtime, RuntimeConfig, observations_queue};
use pgonce_incidents::{NotifierConfig, Service, ServiceConfig, invariants, store};
use pgonce_testkit::webhook::{ReceiverFaults, WebhookReceiver};
use pgonce_testkit::{TableLock, fresh_migrated_database};
use serde_json::json;

fn config(webhook: &str, visibility: Duration) -> RuntimeConfig {
    let mut notifier = NotifierConfig::new(webhook);
    notifier.timeout = Duration::from_millis(300);
    notifier.lease = Duration::from_secs(1);
    notifier.idle = Duration::from_millis(20);
    notifier.retry = RetryPolicy {
        base: Duration::from_millis(50),
        max: Duration::from_millis(200),
        jitter: 0.0,
    };
    RuntimeConfig {
        workers: 2,
        worker: WorkerConfig {
            concurrency: 8,
            wait: Duration::from_millis(200),
            heartbeat_interval: None,
            failure_visibility: Some(Duration::from_millis(50)),
            shutdown_deadline: Duration::from_secs(2),
            ..WorkerConfig::default()
        },
        evaluator: SimulatedEvaluatorConfig {
            latency: Duration::from_millis(5),
            jitter: Duration::from_millis(10),
            failure_rate: 0.02,
            slow_rate: 0.1,
            slow_latency: visibility + Duration::from_millis(300),
        },
        notifier: Some(notifier),
        job_maintenance: true,
        reaper: ReaperConfig {
            interval: Duration::from_millis(100),
            ..ReaperConfig::default()
        },
        redriver: RedriverConfig {
            interval: Duration::from_millis(50),
            ..RedriverConfig::default()
        },
        ledger_cleaner: None,
    }
}

/// A migrated database with organization `acme` and one singleton policy.
struct Acme {
    _db: pgonce_testkit::ScratchDatabase,
    pool: sqlx::PgPool,
    service: Service,
    org: i64,
}

fn cpu_over_50() -> Rule {
    Rule {
        attribute: "cpu".into(),
        op: Op::Gt,
        value: 50.0,
    }
}

/// Sends an observation of `entity` in its entity's group.
async fn send(queue: &pgonce::PgQueue, org: i64, entity: &str, attributes: serde_json::Value) {
    send_with_id(queue, org, entity, attributes, None).await
}

async fn send_with_id(
    queue: &pgonce::PgQueue,
    org: i64,
    entity: &str,
    attributes: serde_json::Value,
    message_id: Option<&str>,
) {
    let o = Observation {
        organization_id: org,
        entity: entity.into(),
        attributes,
        message_id: message_id.map(str::to_owned),
    };
    queue
        .send(SendMessage::new(serde_json::to_string(&o).unwrap()).group(o.group()))
        .await
        .unwrap();
}

/// The next delivery of `queue`, waiting up to 5 s for one.
async fn receive_one(queue: &pgonce::PgQueue) -> pgonce::Received {
    let wait = pgonce::ReceiveRequest {
        wait: Duration::from_secs(5),
        ..pgonce::ReceiveRequest::up_to(1)
    };
    queue.receive(wait).await.unwrap().remove(0)
}

async fn acme_with_policy(name: &str, rule: &Rule) -> Acme {
    let (db, pool) = fresh_migrated_database(20, pgonce_incidents::migrate).await;
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let (org, _) = store::create_organization(&pool, "acme").await.unwrap();
    store::create_policy(&pool, org.id, name, Singleton::Always, rule)
        .await
        .unwrap();
    Acme {
        _db: db,
        pool,
        service,
        org: org.id,
    }
}

/// The plain path (rollout 0) has the duplicate-incident bug: the same
/// redelivery pattern leaves a singleton policy with two OPEN incidents for an
/// entity.
#[tokio::test]
async fn without_the_guard_a_redelivered_message_breaks_i1() {
    let Acme {
        _db,
        pool,
        service,
        org,
    } = acme_with_policy("one", &cpu_over_50()).await;
    store::set_rollout_percent(&pool, 0).await.unwrap();
    let receiver = WebhookReceiver::start(ReceiverFaults::default())
        .await
        .unwrap();
    let visibility = Duration::from_millis(200);
    let queue = observations_queue(&pool, visibility, 20).await.unwrap();
    let mut c = config(receiver.url(), visibility);
    // Every evaluation outlives the visibility timeout once: the message is
    // delivered again and both deliveries decide on "none open".
    c.evaluator = SimulatedEvaluatorConfig {
        latency: Duration::from_millis(5),
        jitter: Duration::ZERO,
        failure_rate: 0.0,
        slow_rate: 1.0,
        slow_latency: visibility + Duration::from_millis(100),
    };
    let runtime = Runtime::start(&service, queue.clone(), c).unwrap();
    send(&queue, org, "e", json!({ "cpu": 90 })).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while invariants::duplicate_open(&pool).await.unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the plain path never duplicated");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(runtime);
}

/// An evaluator of one's own (here: a rule that reads the entity name)
/// plugged into the runtime: it decides, the pipeline opens the incident.
#[tokio::test]
async fn the_runtime_runs_a_pluggable_evaluator() {
    use pgonce_incidents::model::{Entity, Policy};
    use pgonce_incidents::pipeline::Evaluator;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Violated for entities whose name starts with "bad-"; counts calls.
    struct ByName(Arc<AtomicU64>);
    impl Evaluator for ByName {
        async fn evaluate(
            &self,
            _policy: &Policy,
            entity: &Entity,
            _observation: &Observation,
        ) -> Result<bool, pgonce::HandlerError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(entity.external_id.starts_with("bad-"))
        }
    }

    // The stored rule would never fire: only the evaluator decides.
    let never = Rule {
        attribute: "absent".into(),
        op: Op::Gt,
        value: 0.0,
    };
    let Acme {
        _db,
        pool,
        service,
        org,
    } = acme_with_policy("named", &never).await;
    let queue = observations_queue(&pool, Duration::from_secs(5), 5)
        .await
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let mut c = config("http://127.0.0.1:9/unused", Duration::from_secs(5));
    c.notifier = None;
    let runtime = Runtime::start_with(&service, queue.clone(), c, ByName(calls.clone())).unwrap();
    for entity in ["bad-1", "good-1"] {
        send(&queue, org, entity, json!({})).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while invariants::tallies(&pool, &[org])
        .await
        .unwrap()
        .messages_processed
        < 2
    {
        assert!(Instant::now() < deadline, "the pipeline never finished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    runtime.shutdown().await.unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), 2);
    let tallies = invariants::tallies(&pool, &[org]).await.unwrap();
    assert_eq!(tallies.incidents, 1, "only bad-1 violates");
}

/// An evaluator that fails (a remote call refused) is a typed, transient
/// error: the message is not recorded as processed and nothing is opened;
/// its redelivery evaluates again and opens the incident once.
#[tokio::test]
async fn a_failed_evaluation_leaves_the_message_for_its_redelivery() {
    use pgonce_incidents::model::{Entity, Policy};
    use pgonce_incidents::pipeline::{Evaluator, ObservationHandler};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Fails its first call, then finds every observation in violation.
    struct FailsOnce(Arc<AtomicU64>);
    impl Evaluator for FailsOnce {
        async fn evaluate(
            &self,
            _policy: &Policy,
            _entity: &Entity,
            _observation: &Observation,
        ) -> Result<bool, pgonce::HandlerError> {
            match self.0.fetch_add(1, Ordering::Relaxed) {
                0 => Err("remote policy engine refused the connection".into()),
                _ => Ok(true),
            }
        }
    }

    let Acme {
        _db,
        pool,
        service,
        org,
    } = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let queue = observations_queue(&pool, Duration::from_millis(100), 5)
        .await
        .unwrap();
    send(&queue, org, "e", json!({ "cpu": 90 })).await;
    let handler = ObservationHandler::new(service, FailsOnce(Arc::new(AtomicU64::new(0))));
    let receive = async || receive_one(&queue).await;

    let first = receive().await;
    let err = handler.process(&first).await.unwrap_err();
    assert!(
        matches!(&err, pgonce_incidents::Error::Evaluation { policy, .. } if policy == "cpu-high"),
        "{err}"
    );
    assert_eq!(err.code(), "evaluation_failed");
    let tallies = invariants::tallies(&pool, &[org]).await.unwrap();
    assert_eq!((tallies.messages_processed, tallies.incidents), (0, 0));

    // The visibility timeout runs out; the redelivery succeeds.
    let again = receive().await;
    assert_eq!(
        (again.id.as_str(), again.receive_count),
        (first.id.as_str(), 2)
    );
    handler.process(&again).await.unwrap();
    let tallies = invariants::tallies(&pool, &[org]).await.unwrap();
    assert_eq!((tallies.messages_processed, tallies.incidents), (1, 1));
    assert_eq!(handler.counters().snapshot().evaluation_failures, 1);
}

/// A producer that resends an observation under its own message id, after
/// the queue's deduplication window (here: as a new queue message), gets
/// one incident from a policy that allows many at once: the pipeline knows
/// the message by the producer's id.
#[tokio::test]
async fn a_late_resend_with_the_producers_message_id_opens_nothing_twice() {
    let acme = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let (pool, org) = (acme.pool.clone(), acme.org);
    store::create_policy(&pool, org, "cpu-any", Singleton::Never, &cpu_over_50())
        .await
        .unwrap();
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let handler = instant_handler(&acme.service);
    for _ in 0..2 {
        send_with_id(
            &queue,
            org,
            "e",
            json!({ "cpu": 90 }),
            Some("sensor-7/0042"),
        )
        .await;
        let delivery = receive_one(&queue).await;
        handler.process(&delivery).await.unwrap();
        queue.delete(&delivery.receipt).await.unwrap();
    }
    let tallies = invariants::tallies(&pool, &[org]).await.unwrap();
    assert_eq!(tallies.incidents, 2, "one per policy, not one per send");
    assert_eq!(
        (tallies.messages_processed, tallies.deliveries_processed),
        (1, 2)
    );
}

/// A late resend of an observation (under its producer's message id, as a
/// new queue message) after a newer observation of the entity was processed
/// leaves the entity's attributes at the newer one's: a resend is the same
/// observation, and is applied once. It opens nothing and its delivery is
/// counted on its ledger row.
#[tokio::test]
async fn a_late_resend_does_not_bring_back_older_attributes() {
    let acme = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let (pool, org) = (acme.pool.clone(), acme.org);
    handle_in_turn(
        &acme,
        &[
            ("e", 90, "sensor-7/0042"),
            ("e", 10, "sensor-7/0043"),
            ("e", 90, "sensor-7/0042"),
        ],
    )
    .await;
    let entity = store::find_entity(&pool, org, "e").await.unwrap();
    assert_eq!(
        entity.attributes,
        json!({ "cpu": 10 }),
        "the latest observation's"
    );
    let rows = ledger(&pool).await;
    let row = |message_id: &str, deliveries| LedgerRow {
        organization_id: org,
        // The ledger keys a producer's id `producer:<id>`.
        message_id: format!("producer:{message_id}"),
        deliveries,
    };
    assert_eq!(rows, [row("sensor-7/0042", 2), row("sensor-7/0043", 1)]);
    let tallies = invariants::tallies(&pool, &[org]).await.unwrap();
    assert_eq!(tallies.incidents, 1);
}

/// A producer's message id that spells the queue's id of an earlier
/// delivery of the same entity (the PostgreSQL queue's ids are "1", "2",
/// ...) is another observation: recorded and evaluated. The ledger kept
/// both kinds of id in one namespace, so the producer's observation was
/// taken for that delivery's resend and dropped, its attributes never
/// recorded.
#[tokio::test]
async fn a_producer_id_that_spells_a_queue_id_is_not_taken_for_a_resend() {
    let acme = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let (pool, org) = (acme.pool.clone(), acme.org);
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let handler = instant_handler(&acme.service);
    send(&queue, org, "e", json!({ "cpu": 90 })).await;
    let first = receive_one(&queue).await;
    handler.process(&first).await.unwrap();
    queue.delete(&first.receipt).await.unwrap();
    send_with_id(&queue, org, "e", json!({ "cpu": 10 }), Some(&first.id)).await;
    let second = receive_one(&queue).await;
    handler.process(&second).await.unwrap();
    queue.delete(&second.receipt).await.unwrap();
    let entity = store::find_entity(&pool, org, "e").await.unwrap();
    assert_eq!(
        entity.attributes,
        json!({ "cpu": 10 }),
        "the producer's observation, id {:?}, recorded",
        first.id
    );
    let rows = ledger(&pool).await;
    assert_eq!(rows.len(), 2, "two observations: {rows:?}");
}

/// Sends each observation (entity, cpu, producer message id) to the
/// observations queue and handles its delivery with an instant evaluator,
/// one after the other.
async fn handle_in_turn(acme: &Acme, observations: &[(&str, i64, &str)]) {
    let queue = observations_queue(&acme.pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let handler = instant_handler(&acme.service);
    for &(entity, cpu, id) in observations {
        send_with_id(&queue, acme.org, entity, json!({ "cpu": cpu }), Some(id)).await;
        let delivery = receive_one(&queue).await;
        handler.process(&delivery).await.unwrap();
        queue.delete(&delivery.receipt).await.unwrap();
    }
}

/// A handler with an instant evaluator, for tests that drive deliveries one
/// at a time.
fn instant_handler(
    service: &Service,
) -> pgonce_incidents::pipeline::ObservationHandler<pgonce_incidents::SimulatedEvaluator> {
    let evaluator = pgonce_incidents::SimulatedEvaluator::new(SimulatedEvaluatorConfig {
        latency: Duration::ZERO,
        jitter: Duration::ZERO,
        failure_rate: 0.0,
        slow_rate: 0.0,
        slow_latency: Duration::ZERO,
    })
    .unwrap();
    pgonce_incidents::pipeline::ObservationHandler::new(service.clone(), evaluator)
}

#[derive(sqlx::FromRow, Debug, PartialEq, Eq)]
struct LedgerRow {
    organization_id: i64,
    message_id: String,
    deliveries: i32,
}

/// The pipeline's ledger, by organization and message id.
async fn ledger(pool: &sqlx::PgPool) -> Vec<LedgerRow> {
    sqlx::query_as(
        "SELECT organization_id, message_id, deliveries FROM incidents.observations
          ORDER BY organization_id, message_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Two organizations that send the same producer message id each get their
/// own ledger row: the second organization's delivery is never counted on
/// the first one's row.
#[tokio::test]
async fn one_message_id_from_two_organizations_is_two_processed_observations() {
    let acme = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let pool = acme.pool.clone();
    let (other, _) = store::create_organization(&pool, "globex").await.unwrap();
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let handler = instant_handler(&acme.service);
    for org in [acme.org, other.id] {
        send_with_id(&queue, org, "e", json!({ "cpu": 1 }), Some("shared-id")).await;
        let delivery = receive_one(&queue).await;
        handler.process(&delivery).await.unwrap();
        queue.delete(&delivery.receipt).await.unwrap();
    }
    let rows = ledger(&pool).await;
    let expected: Vec<LedgerRow> = [acme.org, other.id]
        .into_iter()
        .map(|organization_id| LedgerRow {
            organization_id,
            message_id: "producer:shared-id".into(),
            deliveries: 1,
        })
        .collect();
    assert_eq!(rows, expected);
}

/// One producer message id carried by observations of two entities, each
/// over the policy's threshold, opens one incident per entity, and the
/// tally of incidents a policy opened twice for one message counts none:
/// it grouped by policy and message id alone, and counted the second
/// entity's incident as a duplicate.
#[tokio::test]
async fn one_message_id_for_two_entities_is_not_an_incident_opened_twice() {
    let acme = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let pool = acme.pool.clone();
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let handler = instant_handler(&acme.service);
    for entity in ["web-1", "web-2"] {
        send_with_id(
            &queue,
            acme.org,
            entity,
            json!({ "cpu": 99 }),
            Some("shared-id"),
        )
        .await;
        let delivery = receive_one(&queue).await;
        handler.process(&delivery).await.unwrap();
        queue.delete(&delivery.receipt).await.unwrap();
    }
    let tallies = invariants::tallies(&pool, &[acme.org]).await.unwrap();
    assert_eq!(tallies.incidents, 2, "one incident per entity");
    assert_eq!(tallies.opened_twice_for_one_message, 0);
}

/// One producer message id carried by observations of two entities is two
/// observations, each applied once: a late resend of the second entity's,
/// after a newer observation of that entity was processed, leaves its
/// attributes at the newer one's, and each entity's delivery is counted on
/// its own ledger row. (The ledger was keyed by organization and message
/// id: the second entity's delivery was counted on the first one's row,
/// so its resend was not recognised and recorded its older attributes
/// again.)
#[tokio::test]
async fn a_late_resend_of_a_second_entity_sharing_a_message_id_is_applied_once() {
    let acme = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let (pool, org) = (acme.pool.clone(), acme.org);
    handle_in_turn(
        &acme,
        &[
            ("web-1", 90, "shared-id"),
            ("web-2", 90, "shared-id"),
            ("web-2", 10, "web-2/0043"),
            ("web-2", 90, "shared-id"),
        ],
    )
    .await;
    let web_2 = store::find_entity(&pool, org, "web-2").await.unwrap();
    assert_eq!(
        web_2.attributes,
        json!({ "cpu": 10 }),
        "web-2's latest observation's"
    );
    let rows: Vec<EntityLedgerRow> = sqlx::query_as(
        "SELECT e.external_id, o.message_id, o.deliveries
           FROM incidents.observations o JOIN incidents.entities e ON e.id = o.entity_id
          ORDER BY e.external_id, o.message_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let row = |entity: &str, message_id: &str, deliveries| EntityLedgerRow {
        external_id: entity.into(),
        // The ledger keys a producer's id `producer:<id>`.
        message_id: format!("producer:{message_id}"),
        deliveries,
    };
    assert_eq!(
        rows,
        [
            row("web-1", "shared-id", 1),
            row("web-2", "shared-id", 2),
            row("web-2", "web-2/0043", 1),
        ]
    );
    let tallies = invariants::tallies(&pool, &[org]).await.unwrap();
    assert_eq!(tallies.incidents, 2, "one incident per entity");
}

/// A ledger row with its entity's external id.
#[derive(sqlx::FromRow, Debug, PartialEq, Eq)]
struct EntityLedgerRow {
    external_id: String,
    message_id: String,
    deliveries: i32,
}

/// A rule value and an attribute at the edge of the double range (the
/// largest finite double, the smallest subnormal) are stored in `jsonb`,
/// read back equal, and evaluated by the pipeline like any other number.
#[tokio::test]
async fn extreme_doubles_go_through_the_pipeline_and_read_back_equal() {
    let huge = f64::MAX;
    let rule = Rule {
        attribute: "x".into(),
        op: Op::Gte,
        value: huge,
    };
    let acme = acme_with_policy("at-max", &rule).await;
    let pool = acme.pool.clone();
    let policies = store::list_policies(&pool, acme.org).await.unwrap();
    assert_eq!(policies[0].rule.value, huge);
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let handler = instant_handler(&acme.service);
    let attributes = json!({ "x": huge, "tiny": 5e-324, "neg": -huge });
    send(&queue, acme.org, "e", attributes.clone()).await;
    let delivery = receive_one(&queue).await;
    handler.process(&delivery).await.unwrap();
    queue.delete(&delivery.receipt).await.unwrap();
    let entity = store::find_entity(&pool, acme.org, "e").await.unwrap();
    assert_eq!(entity.attributes, attributes);
    let tallies = invariants::tallies(&pool, &[acme.org]).await.unwrap();
    assert_eq!(tallies.incidents, 1, "x >= f64::MAX opens the incident");
}

/// An observation whose attributes would print far longer than they were
/// sent (`1e308` as 309 digits, past their bound) is malformed: its
/// delivery fails, counted as malformed, left to be dead-lettered, with
/// no entity recorded; an observation whose few such numbers print within
/// the bound is recorded as any other.
#[tokio::test]
async fn an_observation_that_would_read_back_far_larger_is_malformed() {
    let acme = acme_with_policy("cpu", &cpu_over_50()).await;
    let pool = acme.pool.clone();
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let handler = instant_handler(&acme.service);
    send(&queue, acme.org, "e", json!({ "x": vec![1e308; 1000] })).await;
    let delivery = receive_one(&queue).await;
    let e = handler.process(&delivery).await.unwrap_err();
    assert!(matches!(e, pgonce_incidents::Error::Invalid { .. }), "{e}");
    assert_eq!(handler.counters().snapshot().malformed, 1);
    assert!(matches!(
        store::find_entity(&pool, acme.org, "e").await,
        Err(pgonce_incidents::Error::NotFound { .. })
    ));
    queue.delete(&delivery.receipt).await.unwrap();
    let few = json!({ "x": vec![1e308; 100] });
    send(&queue, acme.org, "e", few.clone()).await;
    let delivery = receive_one(&queue).await;
    handler.process(&delivery).await.unwrap();
    let entity = store::find_entity(&pool, acme.org, "e").await.unwrap();
    assert_eq!(entity.attributes, few);
    assert_eq!(handler.counters().snapshot().malformed, 1);
}

/// A negative zero is zero through the pipeline: an observation's `-0.0`
/// is queued as taken and recorded as the `0.0` `jsonb` keeps (a `numeric`
/// has no signed zero), which the entity reads back; a rule value of
/// `-0.0`, created and read back as `0.0`, is violated by it as `0.0`
/// would be (`x >= 0`).
#[tokio::test]
async fn a_negative_zero_goes_through_the_pipeline_as_zero() {
    let rule = Rule {
        attribute: "x".into(),
        op: Op::Gte,
        value: -0.0,
    };
    let acme = acme_with_policy("at-zero", &rule).await;
    let pool = acme.pool.clone();
    let policies = store::list_policies(&pool, acme.org).await.unwrap();
    assert!(
        policies[0].rule.value.is_sign_positive(),
        "read back as 0.0"
    );
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let handler = instant_handler(&acme.service);
    send(&queue, acme.org, "e", json!({ "x": -0.0, "y": [-0.0] })).await;
    let delivery = receive_one(&queue).await;
    handler.process(&delivery).await.unwrap();
    queue.delete(&delivery.receipt).await.unwrap();
    let stored: String = sqlx::query_scalar("SELECT attributes::text FROM incidents.entities")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stored, r#"{"x": 0.0, "y": [0.0]}"#);
    let entity = store::find_entity(&pool, acme.org, "e").await.unwrap();
    assert_eq!(entity.attributes.to_string(), r#"{"x":0.0,"y":[0.0]}"#);
    let tallies = invariants::tallies(&pool, &[acme.org]).await.unwrap();
    assert_eq!(tallies.incidents, 1, "x >= -0.0 is x >= 0.0");
}

/// A runtime stops while its job reaper and re-driver wait on a lock: with
/// `pgonce.jobs` locked by the test (a migration's lock, a `VACUUM
/// FULL`'s) and both loops' passes seen blocked on it, `shutdown` returns
/// while the lock is still held, and `progress` said both were running
/// until then. (The loops heard their shutdown between passes only, so
/// the stop, and `pgonce serve`'s drain, waited for as long as the lock
/// was held.)
#[tokio::test]
async fn a_runtime_stops_while_its_job_maintenance_waits_on_a_lock() {
    let Acme {
        _db, pool, service, ..
    } = acme_with_policy("quiet", &cpu_over_50()).await;
    let queue = observations_queue(&pool, Duration::from_secs(5), 5)
        .await
        .unwrap();
    let lock = TableLock::take(&pool, "pgonce.jobs").await.unwrap();
    let mut c = config("http://127.0.0.1:9/unused", Duration::from_secs(5));
    c.workers = 0;
    c.notifier = None;
    let runtime = Runtime::start(&service, queue, c).unwrap();
    let progress = runtime.progress();
    // Each loop's first pass runs at once: wait until both wait on the lock.
    lock.wait_until_blocking(&pool, 2, Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(progress.unfinished().job_maintenance, 2);
    tokio::time::timeout(Duration::from_secs(20), runtime.shutdown())
        .await
        .expect("the stop waited for the passes blocked on the lock")
        .unwrap();
    assert!(
        progress.unfinished().is_empty(),
        "{:?}",
        progress.unfinished()
    );
    lock.release().await.unwrap();
}

/// Ages the ledger rows of `message_ids` (producer ids) by `days`, as if
/// their last delivery was that long ago.
async fn age_ledger_rows(pool: &sqlx::PgPool, message_ids: &[&str], days: i32) {
    let keys: Vec<String> = message_ids
        .iter()
        .map(|id| format!("producer:{id}"))
        .collect();
    let aged = sqlx::query(
        "UPDATE incidents.observations
            SET processed_at = processed_at - make_interval(days => $2)
          WHERE message_id = ANY($1)",
    )
    .bind(&keys)
    .bind(days)
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(aged.rows_affected(), keys.len() as u64);
}

fn ledger_cleaner(batch_size: i64) -> LedgerCleanerConfig {
    LedgerCleanerConfig {
        retention: MIN_LEDGER_RETENTION,
        interval: Duration::from_millis(50),
        batch_size,
    }
}

/// The ledger's cleaner deletes the rows whose last delivery is past the
/// retention, a batch at a time, and only those: a resend of a row it
/// kept is still a repeat, and one of a row it forgot is processed as a
/// new observation (the retention is how late a resend is caught).
#[tokio::test]
async fn the_ledger_cleaner_forgets_only_rows_past_their_retention() {
    let acme = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let (pool, org) = (acme.pool.clone(), acme.org);
    handle_in_turn(
        &acme,
        &[("e", 10, "old-1"), ("e", 10, "old-2"), ("e", 10, "recent")],
    )
    .await;
    age_ledger_rows(&pool, &["old-1", "old-2"], 29).await;
    // The row of `recent` aged too, but within the retention.
    age_ledger_rows(&pool, &["recent"], 27).await;

    let forgotten = forget_processed(&pool, &ledger_cleaner(1)).await.unwrap();
    assert_eq!(forgotten, 2, "one batch per row, then a short one");
    let row = |message_id: &str, deliveries| LedgerRow {
        organization_id: org,
        message_id: format!("producer:{message_id}"),
        deliveries,
    };
    assert_eq!(ledger(&pool).await, [row("recent", 1)]);
    assert_eq!(
        forget_processed(&pool, &ledger_cleaner(1)).await.unwrap(),
        0
    );

    handle_in_turn(&acme, &[("e", 10, "recent"), ("e", 10, "old-1")]).await;
    assert_eq!(
        ledger(&pool).await,
        [row("old-1", 1), row("recent", 2)],
        "the kept row counted its resend; the forgotten one is new again"
    );
}

/// A delivery that is updating a row past the retention (its resend,
/// counted on the row, its transaction still open) is neither waited for
/// nor undone by the cleaner: the pass skips the row it holds, and once
/// the delivery commits the row is recent and stays.
#[tokio::test]
async fn a_row_a_delivery_is_updating_is_skipped_and_kept() {
    let acme = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let pool = acme.pool.clone();
    handle_in_turn(&acme, &[("e", 10, "resent")]).await;
    age_ledger_rows(&pool, &["resent"], 29).await;
    let mut delivery = pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE incidents.observations
            SET deliveries = deliveries + 1, processed_at = now()
          WHERE message_id = 'producer:resent'",
    )
    .execute(&mut *delivery)
    .await
    .unwrap();
    let pass = tokio::time::timeout(
        Duration::from_secs(30),
        forget_processed(&pool, &ledger_cleaner(10)),
    )
    .await
    .expect("the pass waited for the delivery's row lock")
    .unwrap();
    assert_eq!(pass, 0, "the row held by the delivery is skipped");
    delivery.commit().await.unwrap();
    assert_eq!(
        forget_processed(&pool, &ledger_cleaner(10)).await.unwrap(),
        0
    );
    let rows = ledger(&pool).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].deliveries, 2);
}

/// A runtime given a ledger cleaner runs it, and its stop ends it: the
/// rows past the retention go, the others stay, and nothing is left
/// running.
#[tokio::test]
async fn a_runtime_runs_its_ledger_cleaner_until_it_stops() {
    let acme = acme_with_policy("cpu-high", &cpu_over_50()).await;
    let pool = acme.pool.clone();
    handle_in_turn(&acme, &[("e", 10, "old"), ("e", 10, "recent")]).await;
    age_ledger_rows(&pool, &["old"], 29).await;
    let queue = observations_queue(&pool, Duration::from_secs(5), 5)
        .await
        .unwrap();
    let mut c = config("http://127.0.0.1:9/unused", Duration::from_secs(5));
    c.workers = 0;
    c.notifier = None;
    c.job_maintenance = false;
    c.ledger_cleaner = Some(ledger_cleaner(10));
    let runtime = Runtime::start(&acme.service, queue, c).unwrap();
    let progress = runtime.progress();
    assert!(progress.unfinished().ledger_cleaner);
    // Waits for the cleaner's first pass, which runs at once; the bound
    // only keeps a broken cleaner from hanging the test.
    let deadline = Instant::now() + Duration::from_secs(30);
    while ledger(&pool).await.len() > 1 {
        assert!(Instant::now() < deadline, "the cleaner never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    runtime.shutdown().await.unwrap();
    assert!(progress.unfinished().is_empty());
    let rows = ledger(&pool).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].message_id, "producer:recent");
}
