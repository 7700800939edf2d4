//! Advisory locks against a real PostgreSQL: the documented SQL derivation,
//! release on commit, rollback and connection death, bounded waits, and
//! many-key acquisition that cannot deadlock.

use std::time::Duration;

use pgonce::Error;
use pgonce::lock::{self, LockKey};
use pgonce_testkit::{Interleaving, fresh_database};
use sqlx::PgPool;

const SQL_DERIVATION: &str = "SELECT ('x' || left(encode(sha256(convert_to($1, 'UTF8') || '\\x00'::bytea || convert_to($2, 'UTF8')), 'hex'), 16))::bit(64)::bigint";

async fn pool() -> PgPool {
    fresh_database().await.pool(8).await.unwrap()
}

#[tokio::test]
async fn the_documented_sql_computes_the_same_key_for_hostile_strings() {
    let pool = pool().await;
    let long = "x".repeat(10_000);
    let cases = [
        ("entity", "42"),
        ("entity", "it's a \"quote\"; DROP TABLE x; --"),
        ("organisation", "Zürich 🚨 ü"),
        ("ns", ""),
        ("ns", long.as_str()),
        ("a:b", "c"),
        ("a", "b:c"),
    ];
    for (namespace, key) in cases {
        let (from_sql,): (i64,) = sqlx::query_as(SQL_DERIVATION)
            .bind(namespace)
            .bind(key)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(
            LockKey::new(namespace, key).unwrap().as_i64(),
            from_sql,
            "{namespace}/{key:.20}"
        );
    }
    assert_ne!(
        LockKey::new("a:b", "c").unwrap(),
        LockKey::new("a", "b:c").unwrap()
    );
}

async fn held_by_anyone(pool: &PgPool, key: LockKey) -> bool {
    let (held,): (bool,) = sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
         AND granted AND (classid::bigint << 32 | objid::bigint) = $1)",
    )
    .bind(key.as_i64())
    .fetch_one(pool)
    .await
    .unwrap();
    held
}

#[tokio::test]
async fn the_lock_is_released_on_commit_and_on_rollback() {
    let pool = pool().await;
    let key = LockKey::new("entity", "release").unwrap();

    let mut tx = pool.begin().await.unwrap();
    lock::lock(&mut tx, key).await.unwrap();
    assert!(
        held_by_anyone(&pool, key).await,
        "visible in pg_locks by the documented expression"
    );
    tx.commit().await.unwrap();
    assert!(!held_by_anyone(&pool, key).await, "released by COMMIT");

    let mut tx = pool.begin().await.unwrap();
    lock::lock(&mut tx, key).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(!held_by_anyone(&pool, key).await, "released by ROLLBACK");
}

#[tokio::test]
async fn the_lock_is_released_when_the_holders_connection_is_killed() {
    let db = fresh_database().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let key = LockKey::new("entity", "killed").unwrap();

    let mut tx_a = a.pool().begin().await.unwrap();
    lock::lock(&mut tx_a, key).await.unwrap();
    let (pid_a,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx_a)
        .await
        .unwrap();

    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "lock", async move {
            let mut tx = pool_b.begin().await?;
            lock::lock(&mut tx, key).await?;
            tx.commit().await?;
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);

    let observer = db.pool(1).await.unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid_a)
        .execute(&observer)
        .await
        .unwrap();
    waiting
        .resume()
        .await
        .unwrap()
        .expect("B gets the lock once A's backend is gone");
    drop(tx_a);
}

#[tokio::test]
async fn try_lock_does_not_wait() {
    let pool = pool().await;
    let key = LockKey::new("entity", "try").unwrap();
    let mut holder = pool.begin().await.unwrap();
    assert!(lock::try_lock(&mut holder, key).await.unwrap());
    let mut other = pool.begin().await.unwrap();
    assert!(!lock::try_lock(&mut other, key).await.unwrap());
    holder.commit().await.unwrap();
    assert!(lock::try_lock(&mut other, key).await.unwrap());
}

#[tokio::test]
async fn a_bounded_wait_times_out_with_a_typed_error_and_leaves_the_transaction_usable() {
    let pool = pool().await;
    let key = LockKey::new("entity", "bounded").unwrap();
    let mut holder = pool.begin().await.unwrap();
    lock::lock(&mut holder, key).await.unwrap();

    let mut waiter = pool.begin().await.unwrap();
    sqlx::query("CREATE TEMP TABLE written_before (x int)")
        .execute(&mut *waiter)
        .await
        .unwrap();
    let err = lock::lock_timeout(&mut waiter, key, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::LockTimeout { key: k, .. } if k == key),
        "{err}"
    );
    // Still usable, earlier work intact, the session's lock_timeout restored.
    let (setting,): (String,) = sqlx::query_as("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut *waiter)
        .await
        .unwrap();
    assert_eq!(setting, "0");
    sqlx::query("INSERT INTO written_before VALUES (1)")
        .execute(&mut *waiter)
        .await
        .unwrap();

    holder.commit().await.unwrap();
    lock::lock_timeout(&mut waiter, key, Duration::from_secs(5))
        .await
        .unwrap();
    waiter.commit().await.unwrap();
}

#[tokio::test]
async fn overlapping_key_sets_in_opposite_order_wait_instead_of_deadlocking() {
    let db = fresh_database().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let k1 = LockKey::new("tag", "one").unwrap();
    let k2 = LockKey::new("tag", "two").unwrap();

    let mut tx_a = a.pool().begin().await.unwrap();
    lock::lock_many(&mut tx_a, [k1, k2]).await.unwrap();
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "lock two, one, two", async move {
            let mut tx = pool_b.begin().await?;
            lock::lock_many(&mut tx, [k2, k1, k2]).await?;
            tx.commit().await?;
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    tx_a.commit().await.unwrap();
    waiting
        .resume()
        .await
        .unwrap()
        .expect("no deadlock: B proceeds after A");
}

#[tokio::test]
async fn keys_of_different_namespaces_do_not_share_a_lock() {
    let pool = pool().await;
    let mut a = pool.begin().await.unwrap();
    lock::lock(&mut a, LockKey::new("entity", "7").unwrap())
        .await
        .unwrap();
    let mut b = pool.begin().await.unwrap();
    assert!(
        lock::try_lock(&mut b, LockKey::new("organisation", "7").unwrap())
            .await
            .unwrap()
    );
}
