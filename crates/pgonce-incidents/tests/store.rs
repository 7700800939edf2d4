//! Creating incidents through the guard against a real PostgreSQL: the
//! seed's sequence, a policy that is a singleton for some entities only
//! (decided at run time), bad input, and a bounded randomized stress with I1
//! checked in the database afterwards.

use std::time::{Duration, Instant};

use pgonce::Error;
use pgonce_incidents::{create_incident, migrate, observe, singleton_violations};
use pgonce_testkit::fresh_database;
use rand::Rng;
use sqlx::PgPool;

struct World {
    pool: PgPool,
    _db: pgonce_testkit::ScratchDatabase,
}

async fn world() -> World {
    let db = fresh_database().await;
    let pool = db.pool(32).await.unwrap();
    migrate(&pool).await.unwrap();
    migrate(&pool).await.unwrap(); // idempotent, and pgonce's versions are ignored
    sqlx::query("INSERT INTO incidents.organizations (name) VALUES ('acme')")
        .execute(&pool)
        .await
        .unwrap();
    World { pool, _db: db }
}

async fn policy(pool: &PgPool, name: &str, singleton: &str) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO incidents.policies (organization_id, name, singleton) VALUES (1, $1, $2) RETURNING id",
    )
    .bind(name)
    .bind(singleton)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn entity(pool: &PgPool, name: &str, singleton: bool) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO incidents.entities (organization_id, external_id, singleton_incidents) VALUES (1, $1, $2) RETURNING id",
    )
    .bind(name)
    .bind(singleton)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn open(pool: &PgPool, policy: i64, entity: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM incidents.incidents WHERE policy_id = $1 AND entity_id = $2 AND lifecycle = 'OPEN'",
    )
    .bind(policy)
    .bind(entity)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_redelivered_message_creates_one_incident_for_a_singleton_policy() {
    let w = world().await;
    let (p, e) = (
        policy(&w.pool, "p", "always").await,
        entity(&w.pool, "X", false).await,
    );
    let seen_w1 = observe(&w.pool, p, e).await.unwrap();
    let seen_w2 = observe(&w.pool, p, e).await.unwrap();
    assert!(seen_w1.open.is_empty() && seen_w2.open.is_empty());
    create_incident(&w.pool, &seen_w1, "W1").await.unwrap();
    let second = create_incident(&w.pool, &seen_w2, "W2").await;
    assert!(matches!(second, Err(Error::Conflict { .. })), "{second:?}");
    assert_eq!(open(&w.pool, p, e).await, 1);
    assert!(singleton_violations(&w.pool).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_policy_can_be_a_singleton_for_some_entities_only_decided_at_run_time() {
    let w = world().await;
    let p = policy(&w.pool, "per", "per_entity").await;
    let (strict, lax) = (
        entity(&w.pool, "strict", true).await,
        entity(&w.pool, "lax", false).await,
    );

    // Singleton for `strict`: the second decision on the same state conflicts.
    let a = observe(&w.pool, p, strict).await.unwrap();
    let b = observe(&w.pool, p, strict).await.unwrap();
    create_incident(&w.pool, &a, "a").await.unwrap();
    assert!(matches!(
        create_incident(&w.pool, &b, "b").await,
        Err(Error::Conflict { .. })
    ));
    assert_eq!(open(&w.pool, p, strict).await, 1);

    // Not for `lax`: both create, legitimately.
    let a = observe(&w.pool, p, lax).await.unwrap();
    let b = observe(&w.pool, p, lax).await.unwrap();
    create_incident(&w.pool, &a, "a").await.unwrap();
    create_incident(&w.pool, &b, "b").await.unwrap();
    assert_eq!(open(&w.pool, p, lax).await, 2);

    // The rule flips at run time between decision and write: the decision was
    // made under "many", the write finds "singleton" and refuses.
    let stale = observe(&w.pool, p, lax).await.unwrap();
    assert!(!stale.singleton);
    sqlx::query("UPDATE incidents.entities SET singleton_incidents = true WHERE id = $1")
        .bind(lax)
        .execute(&w.pool)
        .await
        .unwrap();
    assert!(matches!(
        create_incident(&w.pool, &stale, "late").await,
        Err(Error::Conflict { .. })
    ));
    assert_eq!(open(&w.pool, p, lax).await, 2, "nothing written");
}

#[tokio::test]
async fn an_unknown_policy_or_entity_is_a_typed_error_and_writes_nothing() {
    let w = world().await;
    let p = policy(&w.pool, "p", "always").await;
    assert!(matches!(
        observe(&w.pool, p, 999).await,
        Err(Error::Invalid { .. })
    ));
    let e = entity(&w.pool, "X", false).await;
    let mut seen = observe(&w.pool, p, e).await.unwrap();
    seen.policy_id = 999;
    assert!(matches!(
        create_incident(&w.pool, &seen, "x").await,
        Err(Error::Invalid { .. })
    ));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM incidents.incidents")
        .fetch_one(&w.pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
}

/// Many tasks, few entities, every message delivered twice (sometimes at
/// once), a short random "evaluation" between read and write: I1 holds in
/// the database afterwards, and every duplicate was refused as a conflict.
#[tokio::test]
async fn randomized_stress_keeps_i1_in_the_database() {
    let w = world().await;
    let always = policy(&w.pool, "always", "always").await;
    let per = policy(&w.pool, "per", "per_entity").await;
    let mut entities = Vec::new();
    for i in 0..3 {
        entities.push(entity(&w.pool, &format!("e{i}"), i % 2 == 0).await);
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for worker in 0..16u64 {
        let pool = w.pool.clone();
        let entities = entities.clone();
        tasks.push(tokio::spawn(async move {
            let (mut created, mut conflicts) = (0u64, 0u64);
            let mut n = 0u64;
            while Instant::now() < deadline && n < 200 {
                n += 1;
                let (e, p, resolve, eval_ms) = {
                    let mut rng = rand::rng();
                    (
                        entities[rng.random_range(0..entities.len())],
                        if rng.random_bool(0.5) { always } else { per },
                        rng.random_bool(0.3),
                        rng.random_range(0..3u64),
                    )
                };
                let seen = observe(&pool, p, e).await.unwrap();
                tokio::time::sleep(Duration::from_millis(eval_ms)).await; // the evaluation
                if resolve && !seen.open.is_empty() {
                    // Another writer of the set: resolving also changes it.
                    sqlx::query(
                        "UPDATE incidents.incidents SET lifecycle = 'RESOLVED', resolved_at = now() \
                         WHERE id = $1 AND lifecycle = 'OPEN'",
                    )
                    .bind(seen.open[0])
                    .execute(&pool)
                    .await
                    .unwrap();
                    continue;
                }
                if seen.singleton && !seen.open.is_empty() {
                    continue; // the evaluator sees one open already
                }
                match create_incident(&pool, &seen, &format!("w{worker}")).await {
                    Ok(_) => created += 1,
                    Err(Error::Conflict { .. }) => conflicts += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            (created, conflicts)
        }));
    }
    let (mut created, mut conflicts) = (0, 0);
    for t in tasks {
        let (a, b) = t.await.unwrap();
        created += a;
        conflicts += b;
    }
    assert!(created > 0, "the stress created incidents");
    assert!(
        conflicts > 0,
        "the stress made decisions race ({created} created)"
    );
    let violations = singleton_violations(&w.pool).await.unwrap();
    assert!(violations.is_empty(), "I1 broken: {violations:?}");
}
