//! The incident service against a real PostgreSQL: guarded creation under
//! redelivery, run-time singleton-ness, numbering shared by the pipeline and
//! declarations, lifecycle transitions and their timeline, idempotent
//! declarations, and typed errors for bad input.

use std::time::Duration;

use pgonce_incidents::model::{Declaration, IncidentFilter, Lifecycle, Op, Rule, Singleton};
use pgonce_incidents::service::{Decision, Observed};
use pgonce_incidents::{Error, Service, ServiceConfig, WritePath, invariants, store};
use pgonce_testkit::{Interleaving, ScratchDatabase, fresh_migrated_database};
use serde_json::json;
use sqlx::PgPool;

struct World {
    _db: ScratchDatabase,
    pool: PgPool,
    service: Service,
    org: i64,
}

async fn world() -> World {
    let (db, pool) = fresh_migrated_database(16, pgonce_incidents::migrate).await;
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let (org, _key) = store::create_organization(&pool, "acme").await.unwrap();
    World {
        _db: db,
        pool,
        service,
        org: org.id,
    }
}

fn rule() -> Rule {
    Rule {
        attribute: "errors".into(),
        op: Op::Gt,
        value: 0.0,
    }
}

impl World {
    async fn policy(&self, name: &str, singleton: Singleton) -> pgonce_incidents::model::Policy {
        store::create_policy(&self.pool, self.org, name, singleton, &rule())
            .await
            .unwrap()
    }

    async fn entity(&self, name: &str) -> i64 {
        store::upsert_entity(&self.pool, self.org, name, &json!({"errors": 1}))
            .await
            .unwrap()
            .id
    }

    async fn open_count(&self, policy: i64, entity: i64) -> usize {
        let filter = IncidentFilter {
            lifecycle: Some(Lifecycle::Open),
            policy_id: Some(policy),
            entity_id: Some(entity),
            ..Default::default()
        };
        self.service.list(self.org, &filter).await.unwrap().len()
    }

    /// I1's violations over the run so far.
    async fn i1(&self) -> Vec<invariants::DuplicateOpen> {
        invariants::duplicate_open(&self.pool).await.unwrap()
    }

    async fn open(&self, seen: &Observed, path: WritePath) -> Result<i64, Error> {
        self.service
            .open_from_pipeline(self.org, seen, "test", path)
            .await
            .map(|i| i.number)
    }
}

fn is_conflict(r: &Result<i64, Error>) -> bool {
    matches!(r, Err(Error::Pgonce(pgonce::Error::Conflict { .. })))
}

/// The duplicate-incident race: one message delivered twice, both
/// deliveries decide on the same state. Guarded: one incident, the second
/// write a conflict. Plain (the naive two transactions, read in one and write
/// in another): two OPEN incidents, I1 broken.
#[tokio::test]
async fn a_redelivered_message_opens_one_incident_guarded_and_two_plain() {
    let w = world().await;
    let policy = w.policy("one-at-a-time", Singleton::Always).await;
    for (path, entity_name, expected_open) in [
        (WritePath::Guarded, "guarded", 1),
        (WritePath::Plain, "plain", 2),
    ] {
        let entity = w.entity(entity_name).await;
        let first = w.service.observe(&policy, entity, "m1").await.unwrap();
        let second = w.service.observe(&policy, entity, "m1").await.unwrap();
        assert_eq!(first.decide(), Decision::Open);
        assert_eq!(second.decide(), Decision::Open);
        w.open(&first, path).await.unwrap();
        let again = w.open(&second, path).await;
        assert_eq!(is_conflict(&again), path == WritePath::Guarded, "{again:?}");
        assert_eq!(w.open_count(policy.id, entity).await, expected_open);
        // A third delivery after the first finished sees what it did.
        let late = w.service.observe(&policy, entity, "m1").await.unwrap();
        assert_eq!(late.decide(), Decision::AlreadyOpenedByMessage);
    }
    let i1 = w.i1().await;
    assert_eq!(i1.len(), 1, "only the plain path broke I1: {i1:?}");
    assert!(invariants::number_gaps(&w.pool).await.unwrap().is_empty());
}

/// I2's check reads a gap back as the organization's figures: numbered
/// 1, 2, 3, then the last renumbered past a hole.
#[tokio::test]
async fn a_gap_in_the_numbers_is_reported_with_its_figures() {
    let w = world().await;
    let policy = w.policy("every-time", Singleton::Never).await;
    for name in ["a", "b", "c"] {
        let entity = w.entity(name).await;
        let seen = w.service.observe(&policy, entity, name).await.unwrap();
        w.open(&seen, WritePath::Guarded).await.unwrap();
    }
    assert!(invariants::number_gaps(&w.pool).await.unwrap().is_empty());
    sqlx::query(
        "UPDATE incidents.incidents SET number = 7 WHERE organization_id = $1 AND number = 3",
    )
    .bind(w.org)
    .execute(&w.pool)
    .await
    .unwrap();
    assert_eq!(
        invariants::number_gaps(&w.pool).await.unwrap(),
        [invariants::NumberGap {
            organization_id: w.org,
            count: 3,
            min: 1,
            max: 7,
            distinct: 3,
        }]
    );
}

/// I1 is about the whole run, not the final state: a duplicate the plain
/// path opened still counts after people acknowledged and resolved both
/// (as the demo's people do while it runs).
#[tokio::test]
async fn a_duplicate_closed_before_the_check_still_breaks_i1() {
    let w = world().await;
    let policy = w.policy("one-at-a-time", Singleton::Always).await;
    let entity = w.entity("e").await;
    let first = w.service.observe(&policy, entity, "m1").await.unwrap();
    let second = w.service.observe(&policy, entity, "m2").await.unwrap();
    let a = w
        .service
        .open_from_pipeline(w.org, &first, "t", WritePath::Plain)
        .await
        .unwrap();
    let b = w
        .service
        .open_from_pipeline(w.org, &second, "t", WritePath::Plain)
        .await
        .unwrap();
    w.service.acknowledge(w.org, b.id, "on-call").await.unwrap();
    w.service.resolve(w.org, a.id, "on-call").await.unwrap();
    assert_eq!(w.open_count(policy.id, entity).await, 0, "none OPEN now");
    let i1 = w.i1().await;
    assert_eq!(i1.len(), 1, "{i1:?}");
    assert_eq!((i1[0].incident_id, i1[0].while_open_id), (b.id, a.id));
}

/// The guard lets a singleton policy open again once the open incident is
/// acknowledged: its re-read sees nothing OPEN, and the history check agrees
/// that the two OPEN intervals never overlapped.
#[tokio::test]
async fn an_incident_opened_after_the_previous_was_acknowledged_keeps_i1() {
    let w = world().await;
    let policy = w.policy("one-at-a-time", Singleton::Always).await;
    let entity = w.entity("e").await;
    let first = w.service.observe(&policy, entity, "m1").await.unwrap();
    let a = w
        .service
        .open_from_pipeline(w.org, &first, "t", WritePath::Guarded)
        .await
        .unwrap();
    let while_open = w.service.observe(&policy, entity, "m2").await.unwrap();
    assert_eq!(while_open.decide(), Decision::AlreadyOpen);
    w.service.acknowledge(w.org, a.id, "on-call").await.unwrap();
    let after = w.service.observe(&policy, entity, "m3").await.unwrap();
    assert_eq!(after.decide(), Decision::Open);
    w.open(&after, WritePath::Guarded).await.unwrap();
    assert_eq!(w.open_count(policy.id, entity).await, 1);
    assert!(w.i1().await.is_empty());
}

/// Singleton-ness is the rule in force when an incident opened: two opened
/// while the entity allowed many are no violation once it allows one.
#[tokio::test]
async fn incidents_opened_while_many_were_allowed_keep_i1_after_the_rule_changes() {
    let w = world().await;
    let policy = w.policy("per-entity", Singleton::PerEntity).await;
    let entity = w.entity("e").await;
    for m in ["m1", "m2"] {
        let seen = w.service.observe(&policy, entity, m).await.unwrap();
        assert!(!seen.singleton);
        w.open(&seen, WritePath::Guarded).await.unwrap();
    }
    store::set_entity_singleton(&w.pool, w.org, entity, true)
        .await
        .unwrap();
    assert_eq!(w.open_count(policy.id, entity).await, 2);
    assert!(w.i1().await.is_empty());
}

/// A policy that may have many open incidents still opens one per message:
/// a redelivery of the same message is refused by the guard.
#[tokio::test]
async fn a_non_singleton_policy_opens_one_incident_per_message() {
    let w = world().await;
    let policy = w.policy("every-time", Singleton::Never).await;
    let entity = w.entity("e").await;
    let a = w.service.observe(&policy, entity, "m1").await.unwrap();
    let b = w.service.observe(&policy, entity, "m1").await.unwrap();
    let c = w.service.observe(&policy, entity, "m2").await.unwrap();
    w.open(&a, WritePath::Guarded).await.unwrap();
    assert!(is_conflict(&w.open(&b, WritePath::Guarded).await));
    w.open(&c, WritePath::Guarded).await.unwrap();
    assert_eq!(w.open_count(policy.id, entity).await, 2);
}

/// Singleton-ness decided at run time: the entity becomes a singleton
/// between the decision and the write; the guard's re-read sees it and
/// refuses, though the decision saw "many allowed".
#[tokio::test]
async fn a_per_entity_singleton_changed_after_the_decision_is_a_conflict() {
    let w = world().await;
    let policy = w.policy("per-entity", Singleton::PerEntity).await;
    let entity = w.entity("e").await;
    let first = w.service.observe(&policy, entity, "m1").await.unwrap();
    w.open(&first, WritePath::Guarded).await.unwrap();
    let seen = w.service.observe(&policy, entity, "m2").await.unwrap();
    assert!(!seen.singleton);
    assert_eq!(seen.decide(), Decision::Open, "many allowed when decided");
    store::set_entity_singleton(&w.pool, w.org, entity, true)
        .await
        .unwrap();
    assert!(is_conflict(&w.open(&seen, WritePath::Guarded).await));
    assert_eq!(w.open_count(policy.id, entity).await, 1);
    assert!(w.i1().await.is_empty());
}

/// Sessions A and B of a race, A holding `entity`'s lock in `tx` (as a
/// guarded write of it does).
struct EntityLockHeld {
    race: Interleaving,
    a: pgonce_testkit::Session,
    b: pgonce_testkit::Session,
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
}

async fn entity_lock_held(w: &World, entity: i64) -> EntityLockHeld {
    let race = Interleaving::new(w._db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let mut tx = a.pool().begin().await.unwrap();
    let key = pgonce_incidents::service::entity_lock_key(entity).unwrap();
    race.step(&a, "hold the entity lock", pgonce::lock::lock(&mut tx, key))
        .await
        .unwrap()
        .unwrap();
    EntityLockHeld { race, a, b, tx }
}

/// Changing an entity's singleton flag waits for a guarded write of that
/// entity in progress (it takes the same lock), so the write's re-read and
/// the flag cannot interleave. Step by step: a transaction holds the
/// entity's lock; the flag change is seen blocked by it.
#[tokio::test]
async fn the_singleton_flag_waits_for_the_entitys_lock() {
    let w = world().await;
    let entity = w.entity("e").await;
    let EntityLockHeld { race, a, b, tx } = entity_lock_held(&w, entity).await;
    let (pool_b, org) = (b.pool().clone(), w.org);
    let waiting = race
        .step_blocks(&b, "set singleton", async move {
            store::set_entity_singleton(&pool_b, org, entity, true).await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    race.step(&a, "COMMIT", tx.commit()).await.unwrap().unwrap();
    waiting.resume().await.unwrap().unwrap();
}

/// Another organization's entity id is answered like an unknown one without
/// touching the entity: the flag change does not take its lock, so it
/// neither waits for that organization's guarded writes (which would tell
/// the caller one is under way) nor holds them up. Step by step: A holds
/// the entity's lock, as a guarded write of its organization does; B, of
/// another organization, sets the flag on that entity id and is answered
/// NotFound without being seen blocked.
#[tokio::test]
async fn the_singleton_flag_of_another_organizations_entity_takes_no_lock() {
    let w = world().await;
    let entity = w.entity("e").await;
    let (other, _) = store::create_organization(&w.pool, "other").await.unwrap();
    let EntityLockHeld { race, a, b, tx } = entity_lock_held(&w, entity).await;
    let pool_b = b.pool().clone();
    let set = async move { store::set_entity_singleton(&pool_b, other.id, entity, true).await };
    let outcome = race.step_blocks(&b, "set singleton as other", set).await;
    assert!(
        matches!(
            outcome,
            Err(pgonce_testkit::HarnessError::DidNotBlock { .. })
        ),
        "waited for another organization's entity lock, blocked by {:?}",
        outcome
            .as_ref()
            .map(|blocked| blocked.blocked_by().to_vec())
    );
    let refused = race
        .step(
            &b,
            "set singleton as other, again",
            store::set_entity_singleton(b.pool(), other.id, entity, true),
        )
        .await
        .unwrap();
    assert!(
        matches!(refused, Err(Error::NotFound { .. })),
        "{refused:?}"
    );
    race.step(&a, "COMMIT", tx.commit()).await.unwrap().unwrap();
    let unchanged = store::get_entity(&w.pool, w.org, entity).await.unwrap();
    assert!(!unchanged.singleton_incidents);
}

/// Per-organization numbering: declarations of one organization wait for the
/// holder of its number lock and then take the next number; another
/// organization's declaration does not wait at all.
#[tokio::test]
async fn declarations_wait_only_for_their_own_organization() {
    let w = world().await;
    let (other, _) = store::create_organization(&w.pool, "other").await.unwrap();
    let race = Interleaving::new(w._db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let c = race.session("C").await.unwrap();
    let mut tx = a.pool().begin().await.unwrap();
    let key = w.service.number_lock_key(w.org).unwrap();
    race.step(
        &a,
        "hold acme's number lock",
        pgonce::lock::lock(&mut tx, key),
    )
    .await
    .unwrap()
    .unwrap();
    let declaration = Declaration {
        title: "db down".into(),
        entity: None,
        idempotency_key: None,
    };
    let on = |s: &pgonce_testkit::Session| {
        Service::new(s.pool().clone(), ServiceConfig::default()).unwrap()
    };
    let (sb, sc) = (on(&b), on(&c));
    let (d, org) = (declaration.clone(), w.org);
    let waiting = race
        .step_blocks(&b, "declare in acme", async move {
            sb.declare(org, &d, "alice").await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    let elsewhere = race
        .step(
            &c,
            "declare in other",
            sc.declare(other.id, &declaration, "bob"),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(elsewhere.number, 1);
    race.step(&a, "ROLLBACK", tx.rollback())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(waiting.resume().await.unwrap().unwrap().number, 1);
}

/// Pipeline creations and declarations by hand in one organization, many at
/// once: numbers stay 1..n and every incident has its notification job.
#[tokio::test]
async fn concurrent_pipeline_creations_and_declarations_keep_numbers_gapless() {
    let w = world().await;
    let policy = w.policy("every-time", Singleton::Never).await;
    let entity = w.entity("e").await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..40 {
        let (service, policy, org) = (w.service.clone(), policy.clone(), w.org);
        tasks.spawn(async move {
            if i % 2 == 0 {
                let seen = service.observe(&policy, entity, &format!("m{i}")).await?;
                service
                    .open_from_pipeline(org, &seen, "p", WritePath::Guarded)
                    .await
            } else {
                let d = Declaration {
                    title: format!("declared {i}"),
                    entity: Some("e".into()),
                    idempotency_key: None,
                };
                service.declare(org, &d, "alice").await
            }
        });
    }
    let mut numbers = Vec::new();
    while let Some(done) = tasks.join_next().await {
        numbers.push(done.unwrap().unwrap().number);
    }
    numbers.sort();
    assert_eq!(numbers, (1..=40).collect::<Vec<_>>());
    assert!(invariants::number_gaps(&w.pool).await.unwrap().is_empty());
    let jobs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgonce.jobs WHERE kind = 'incident-notification'")
            .fetch_one(&w.pool)
            .await
            .unwrap();
    assert_eq!(jobs, 40);
}

/// A declaration's idempotency key: declaring twice returns the first
/// incident and takes no second number.
#[tokio::test]
async fn a_declaration_with_a_key_is_made_once() {
    let w = world().await;
    let d = Declaration {
        title: "checkout failing".into(),
        entity: None,
        idempotency_key: Some("pager-123".into()),
    };
    let first = w.service.declare(w.org, &d, "alice").await.unwrap();
    let again = w.service.declare(w.org, &d, "alice").await.unwrap();
    assert_eq!(first.id, again.id);
    let other = Declaration {
        idempotency_key: Some("pager-124".into()),
        ..d
    };
    assert_eq!(
        w.service
            .declare(w.org, &other, "alice")
            .await
            .unwrap()
            .number,
        2
    );
}

/// A declaration waits for its idempotency key's lock at most
/// `declaration_lock_timeout`, then fails as `busy` (a 503 that names no
/// lock), with nothing written and its connection back in the pool; once
/// the holder is done, the same declaration is made. Step by step: A holds
/// the key's lock, B's declaration is seen blocked by it in pg_locks.
#[tokio::test]
async fn a_declaration_waits_for_its_keys_lock_only_so_long() {
    let w = world().await;
    let race = Interleaving::new(w._db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let mut tx = a.pool().begin().await.unwrap();
    let key = pgonce_incidents::service::declaration_lock_key(w.org, "pager-1").unwrap();
    race.step(&a, "hold the key's lock", pgonce::lock::lock(&mut tx, key))
        .await
        .unwrap()
        .unwrap();
    // Well within the harness's step timeout, which the wait without a
    // bound runs into instead.
    let config = ServiceConfig {
        declaration_lock_timeout: Duration::from_secs(2),
        ..ServiceConfig::default()
    };
    let service = Service::new(b.pool().clone(), config).unwrap();
    let d = Declaration {
        title: "db down".into(),
        entity: None,
        idempotency_key: Some("pager-1".into()),
    };
    let (sb, db, org) = (service.clone(), d.clone(), w.org);
    let waiting = race
        .step_blocks(&b, "declare with the key", async move {
            sb.declare(org, &db, "alice").await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    let refused = waiting.resume().await.unwrap().unwrap_err();
    assert!(
        matches!(&refused, Error::Pgonce(pgonce::Error::LockTimeout { key: k, .. }) if *k == key),
        "{refused:?}"
    );
    let answer = pgonce_incidents::api::ApiError::from(refused);
    assert_eq!((answer.status.as_u16(), answer.code), (503, "busy"));
    assert!(
        !answer.message.contains(&key.to_string()),
        "{}",
        answer.message
    );
    assert!(
        w.service
            .list(w.org, &IncidentFilter::default())
            .await
            .unwrap()
            .is_empty()
    );
    race.step(&a, "COMMIT", tx.commit()).await.unwrap().unwrap();
    // B's one connection is back in its pool, its transaction ended.
    let made = race
        .step(&b, "declare again", service.declare(w.org, &d, "alice"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(made.number, 1);
}

/// A declaration whose number another process took meanwhile (one still on
/// another `service.numbering`, during a deploy that changes it: each
/// strategy takes only its own lock) fails as `busy`, a 503 the client
/// retries, not `internal`; nothing of it is written, and the retry takes
/// the next number. Step by step: A, standing in for the other strategy's
/// declaration, holds its uncommitted incident numbered 1; B's declaration
/// computes 1 as well and is seen blocked by A on the unique index; A
/// commits.
#[tokio::test]
async fn a_number_another_numbering_strategy_took_meanwhile_is_busy() {
    let w = world().await;
    let race = Interleaving::new(w._db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let mut tx = a.pool().begin().await.unwrap();
    let insert = sqlx::query(
        "INSERT INTO incidents.incidents (organization_id, number, title, opened_by) \
         VALUES ($1, 1, 'numbered by the other strategy', 'bob')",
    )
    .bind(w.org)
    .execute(&mut *tx);
    race.step(&a, "insert incident 1", insert)
        .await
        .unwrap()
        .unwrap();
    let service = Service::new(b.pool().clone(), ServiceConfig::default()).unwrap();
    let d = Declaration {
        title: "db down".into(),
        entity: None,
        idempotency_key: None,
    };
    let (sb, db, org) = (service.clone(), d.clone(), w.org);
    let waiting = race
        .step_blocks(
            &b,
            "declare",
            async move { sb.declare(org, &db, "alice").await },
        )
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    race.step(&a, "COMMIT", tx.commit()).await.unwrap().unwrap();
    let refused = waiting.resume().await.unwrap().unwrap_err();
    assert!(
        matches!(
            &refused,
            Error::Pgonce(pgonce::Error::NumberTaken { number: 1, .. })
        ),
        "{refused:?}"
    );
    let answer = pgonce_incidents::api::ApiError::from(refused);
    assert_eq!(
        (answer.status.as_u16(), answer.code),
        (503, "busy"),
        "{}",
        answer.message
    );
    let titles: Vec<String> = w
        .service
        .list(w.org, &IncidentFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.title)
        .collect();
    assert_eq!(titles, ["numbered by the other strategy"]);
    let made = race
        .step(&b, "declare again", service.declare(w.org, &d, "alice"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(made.number, 2);
}

/// A declaration lock timeout that PostgreSQL's `lock_timeout` cannot hold
/// (0 there means no bound; past `MAX_LOCK_TIMEOUT` it does not fit) is
/// refused when the service is built, not at the first declaration.
#[tokio::test]
async fn a_declaration_lock_timeout_out_of_range_is_refused() {
    let w = world().await;
    let past = pgonce::lock::MAX_LOCK_TIMEOUT + Duration::from_millis(1);
    for timeout in [Duration::ZERO, Duration::from_micros(999), past] {
        let config = ServiceConfig {
            declaration_lock_timeout: timeout,
            ..ServiceConfig::default()
        };
        assert!(
            matches!(
                Service::new(w.pool.clone(), config),
                Err(Error::Invalid {
                    what: "declaration_lock_timeout",
                    ..
                })
            ),
            "{timeout:?}"
        );
    }
}

/// OPEN -> ACKNOWLEDGED -> RESOLVED, each change once, each on the
/// timeline in order; a second resolve is an invalid transition; another
/// organization cannot see or touch the incident.
#[tokio::test]
async fn the_lifecycle_moves_forward_once_and_is_on_the_timeline() {
    let w = world().await;
    let d = Declaration {
        title: "latency".into(),
        entity: None,
        idempotency_key: None,
    };
    let incident = w.service.declare(w.org, &d, "alice").await.unwrap();
    let acked = w
        .service
        .acknowledge(w.org, incident.id, "bob")
        .await
        .unwrap();
    assert_eq!(acked.lifecycle, Lifecycle::Acknowledged);
    assert_eq!(acked.acknowledged_by.as_deref(), Some("bob"));
    assert!(matches!(
        w.service.acknowledge(w.org, incident.id, "bob").await,
        Err(Error::InvalidTransition { .. })
    ));
    let resolved = w
        .service
        .resolve(w.org, incident.id, "carol")
        .await
        .unwrap();
    assert_eq!(resolved.lifecycle, Lifecycle::Resolved);
    assert!(matches!(
        w.service.resolve(w.org, incident.id, "carol").await,
        Err(Error::InvalidTransition { .. })
    ));
    let types: Vec<String> = w
        .service
        .timeline(w.org, incident.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.event.event_type)
        .collect();
    assert_eq!(
        types,
        ["IncidentOpened", "IncidentAcknowledged", "IncidentResolved"]
    );

    let (other, _) = store::create_organization(&w.pool, "other").await.unwrap();
    for r in [
        w.service.get(other.id, incident.id).await.map(|_| ()),
        w.service
            .resolve(other.id, incident.id, "x")
            .await
            .map(|_| ()),
        w.service.timeline(other.id, incident.id).await.map(|_| ()),
    ] {
        assert!(matches!(r, Err(Error::NotFound { .. })), "{r:?}");
    }
    let page = w.service.feed(w.org, 0, 100, Duration::ZERO).await.unwrap();
    assert_eq!(page.events.len(), 3);
    let empty = w
        .service
        .feed(other.id, 0, 100, Duration::ZERO)
        .await
        .unwrap();
    assert!(
        empty.events.is_empty(),
        "another organization's feed is its own"
    );
    let after = w
        .service
        .feed(w.org, page.next, 100, Duration::from_millis(150))
        .await
        .unwrap();
    assert!(after.events.is_empty());
}

/// A feed page gets past a rolled-back position and past other
/// organizations' events without the caller waiting (wait zero), even one
/// position at a time (limit one).
#[tokio::test]
async fn the_feed_passes_a_rolled_back_position_and_other_organizations_events_at_once() {
    use pgonce::events::Event;
    let w = world().await;
    let (other, _) = store::create_organization(&w.pool, "other").await.unwrap();
    // A position drawn and rolled back: a hole that will never fill.
    let events = pgonce::EventStore::new(w.pool.clone(), Default::default()).unwrap();
    let mut tx = w.pool.begin().await.unwrap();
    events
        .append_in(
            &mut tx,
            &[Event::new("Abandoned").tag(format!("org:{}", w.org))],
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let declaration = |title: &str| Declaration {
        title: title.into(),
        entity: None,
        idempotency_key: None,
    };
    for i in 0..3 {
        w.service
            .declare(other.id, &declaration(&format!("theirs {i}")), "bob")
            .await
            .unwrap();
    }
    let ours = w
        .service
        .declare(w.org, &declaration("ours"), "alice")
        .await
        .unwrap();
    let page = w.service.feed(w.org, 0, 1, Duration::ZERO).await.unwrap();
    let (first, next) = (&page.events, page.next);
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].event.event_type, "IncidentOpened");
    assert_eq!(first[0].event.data["title"], "ours");
    assert_eq!(next, first[0].position);
    let rest = w
        .service
        .feed(w.org, next, 1, Duration::ZERO)
        .await
        .unwrap();
    assert!(rest.events.is_empty());
    assert_eq!(rest.next, next, "nothing after it");
    assert_eq!(w.service.get(w.org, ours.id).await.unwrap().number, 1);
}

/// Bad input is a typed error and writes nothing.
#[tokio::test]
async fn bad_input_is_a_typed_error_and_writes_nothing() {
    let w = world().await;
    let policy = w.policy("p", Singleton::Always).await;
    let unknown = w.service.observe(&policy, 999_999, "m").await;
    assert!(
        matches!(unknown, Err(Error::Pgonce(pgonce::Error::Invalid { .. }))),
        "{unknown:?}"
    );
    for title in ["", &"x".repeat(1001)] {
        let d = Declaration {
            title: title.into(),
            entity: None,
            idempotency_key: None,
        };
        assert!(matches!(
            w.service.declare(w.org, &d, "a").await,
            Err(Error::Invalid { .. })
        ));
    }
    let d = Declaration {
        title: "ok".into(),
        entity: Some("no-such-entity".into()),
        idempotency_key: None,
    };
    assert!(matches!(
        w.service.declare(w.org, &d, "a").await,
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        w.service.declare(424_242, &d, "a").await,
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        store::create_organization(&w.pool, "acme").await,
        Err(Error::AlreadyExists { .. })
    ));
    assert!(matches!(
        store::upsert_entity(&w.pool, 424_242, "e", &json!({})).await,
        Err(Error::NotFound { .. })
    ));
    let hostile = "'; DROP TABLE incidents.incidents; --";
    let d = Declaration {
        title: hostile.into(),
        entity: None,
        idempotency_key: None,
    };
    assert_eq!(
        w.service.declare(w.org, &d, "a").await.unwrap().title,
        hostile
    );
    assert_eq!(
        w.service
            .list(w.org, &IncidentFilter::default())
            .await
            .unwrap()
            .len(),
        1,
        "only the hostile-titled incident was written"
    );
}

/// API keys: the right key finds its organization; anything else, the
/// same Unauthorized.
#[tokio::test]
async fn api_keys_authenticate_their_organization_only() {
    let w = world().await;
    let (org, key) = store::create_organization(&w.pool, "keys").await.unwrap();
    assert_eq!(store::authenticate(&w.pool, &key).await.unwrap(), org.id);
    let mut wrong = key.clone();
    wrong.pop();
    wrong.push(if key.ends_with('0') { '1' } else { '0' });
    for bad in [wrong.as_str(), "", "pgo_", "Bearer x", "pgo_abc_def"] {
        assert!(
            matches!(
                store::authenticate(&w.pool, bad).await,
                Err(Error::Unauthorized(_))
            ),
            "{bad:?}"
        );
    }
}

/// `SCHEMA`, what `migrate` checks is still there after a run, is what the
/// service's migrations make: a table added without it, or a name
/// in it that none makes, fails here.
#[tokio::test]
async fn the_schema_checked_after_a_run_is_what_the_migrations_make() {
    let (_db, pool) = fresh_migrated_database(1, pgonce_incidents::migrate).await;
    let schema = pgonce_incidents::SCHEMA;
    let catalog = pgonce_testkit::schema_catalog(&pool, schema.name)
        .await
        .unwrap();
    assert_eq!(catalog.tables, schema.tables);
    assert_eq!(catalog.functions, schema.functions);
}

/// A database whose encoding is not UTF8 is refused by `migrate`, before
/// anything is applied, with an error naming its encoding: on one in
/// LATIN1, a title, external id or attribute holding a character LATIN1
/// lacks (an emoji) fails its statement (SQLSTATE 22P05), and under
/// SQL_ASCII PostgreSQL's `length()` counts bytes, so the tables' CHECKs
/// refuse a name of 200 two-byte characters the API accepts: each a 500
/// for valid input, and the pipeline's retries of such an observation
/// until it is dead-lettered. (The test cluster's locale is C, which
/// takes any encoding.)
#[tokio::test]
async fn a_database_not_in_utf8_is_refused_before_anything_is_migrated() {
    let server = pgonce_testkit::server::shared_for_tests().unwrap();
    // A scratch database of its own, for a unique name and a connection
    // that creates and drops the others.
    let scratch = pgonce_testkit::fresh_database().await;
    let admin_pool = scratch.pool(1).await.unwrap();
    for encoding in ["LATIN1", "SQL_ASCII"] {
        let name = format!("{}_{}", scratch.name(), encoding.to_lowercase());
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {name} ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' \
             TEMPLATE template0"
        )))
        .execute(&admin_pool)
        .await
        .unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(server.options().clone().database(&name))
            .await
            .unwrap();
        let refused = pgonce_incidents::migrate(&pool).await;
        let schemas: Vec<String> = sqlx::query_scalar(
            "SELECT nspname::text FROM pg_namespace WHERE nspname IN ('pgonce', 'incidents')",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}")))
            .execute(&admin_pool)
            .await
            .unwrap();
        let refused = refused.expect_err(encoding);
        let text = pgonce::error::describe(&sqlx::Error::Migrate(Box::new(refused)));
        assert!(
            text.contains(encoding) && text.contains("UTF8"),
            "{encoding}: {text}"
        );
        assert!(schemas.is_empty(), "{encoding}: {schemas:?}");
    }
}
