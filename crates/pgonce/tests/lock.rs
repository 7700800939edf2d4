//! Advisory locks against a real PostgreSQL: the documented SQL derivation,
//! release on commit, rollback and connection death, bounded waits, and
//! many-key acquisition that cannot deadlock.

use std::time::Duration;

use pgonce::Error;
use pgonce::lock::{self, LockKey};
use pgonce_testkit::{Interleaving, fresh_database};
use sqlx::PgPool;

async fn pool() -> PgPool {
    fresh_database().await.pool(8).await.unwrap()
}

async fn derived_in_sql(pool: &PgPool, namespace: &str, key: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar(lock::DERIVE_KEY_SQL)
        .bind(namespace)
        .bind(key)
        .fetch_one(pool)
        .await
}

/// Namespaces and keys that could trip an encoding, a quote or a hash
/// block boundary.
fn hostile_cases() -> Vec<(String, String)> {
    let long = "x".repeat(10_000);
    let long_unicode = "ü🚨\u{0301}".repeat(3_000);
    let mut cases: Vec<(String, String)> = [
        ("entity", "42"),
        ("entity", "it's a \"quote\"; DROP TABLE x; --"),
        ("organisation", "Zürich 🚨 ü"),
        ("ns", ""),
        ("ns", long.as_str()),
        (long.as_str(), "k"),
        (long_unicode.as_str(), long_unicode.as_str()),
        ("a:b", "c"),
        ("a", "b:c"),
        ("日本語", "キー"),
        ("e\u{0301}", "\u{00e9}"),
        ("\u{feff}bom", "\u{10ffff}"),
        ("tab\there", "new\nline\r\n"),
        ("back\\slash", "\\x00"),
        (" ", "\u{7f}\u{1}"),
    ]
    .iter()
    .map(|(n, k)| (n.to_string(), k.to_string()))
    .collect();
    // A range of lengths around the hash's block sizes, over a mixed alphabet.
    let alphabet: Vec<char> = "aZ9 ü€🚨\u{0301}'\\".chars().collect();
    for len in 0..=130usize {
        let key: String = (0..len)
            .map(|i| alphabet[(i * 7 + len) % alphabet.len()])
            .collect();
        cases.push((format!("len-{len}"), key));
    }
    cases
}

#[tokio::test]
async fn the_documented_sql_computes_the_same_key_for_hostile_strings() {
    let pool = pool().await;
    let cases = hostile_cases();
    for (namespace, key) in &cases {
        let from_sql = derived_in_sql(&pool, namespace, key).await.unwrap();
        assert_eq!(
            LockKey::new(namespace, key).unwrap().as_i64(),
            from_sql,
            "{namespace:.20}/{key:.20}"
        );
    }
    assert_ne!(
        LockKey::new("a:b", "c").unwrap(),
        LockKey::new("a", "b:c").unwrap()
    );
}

/// `pgonce.lock_key`, the same derivation as a function in the schema
/// (migration 0132), which statements use to lock a key they learn from
/// their own rows (a dead-letter move locks its message's group).
#[tokio::test]
async fn the_schemas_lock_key_function_computes_the_same_key() {
    let (_db, pool) = pgonce_testkit::fresh_migrated_database(2, pgonce::migrate).await;
    for (namespace, key) in &hostile_cases() {
        let from_sql: i64 = sqlx::query_scalar("SELECT pgonce.lock_key($1, $2)")
            .bind(namespace)
            .bind(key)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(
            LockKey::new(namespace, key).unwrap().as_i64(),
            from_sql,
            "{namespace:.20}/{key:.20}"
        );
    }
}

/// A NUL byte cannot reach the SQL derivation (PostgreSQL's text refuses
/// it), so a key containing one is one no other client could compute:
/// `LockKey::new` refuses it in the key as in the namespace.
#[tokio::test]
async fn a_nul_in_namespace_or_key_is_refused_as_sql_cannot_derive_it() {
    let pool = pool().await;
    for (namespace, key) in [("ns", "a\0b"), ("ns", "\0"), ("n\0s", "k")] {
        assert!(
            derived_in_sql(&pool, namespace, key).await.is_err(),
            "PostgreSQL text takes no NUL: {namespace:?}/{key:?}"
        );
        match LockKey::new(namespace, key) {
            Err(Error::Invalid { what, .. }) => {
                assert!(what.starts_with("lock "), "{what}")
            }
            other => panic!("{namespace:?}/{key:?}: expected Invalid, got {other:?}"),
        }
    }
}

async fn held_by_anyone(pool: &PgPool, key: LockKey) -> bool {
    let held: bool = sqlx::query_scalar(
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
    let pid_a: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
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
    // A lock_timeout of the session's own, which the bounded wait must put
    // back whichever way it ends.
    sqlx::query("SET lock_timeout = '7s'")
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
    let setting: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut *waiter)
        .await
        .unwrap();
    assert_eq!(setting, "7s");
    sqlx::query("INSERT INTO written_before VALUES (1)")
        .execute(&mut *waiter)
        .await
        .unwrap();

    holder.commit().await.unwrap();
    lock::lock_timeout(&mut waiter, key, Duration::from_secs(5))
        .await
        .unwrap();
    // Granted: held by the waiter's transaction (the savepoint it was taken
    // in is gone), the session's setting back, the earlier row still there.
    let mut other = pool.begin().await.unwrap();
    assert!(!lock::try_lock(&mut other, key).await.unwrap());
    other.rollback().await.unwrap();
    let setting: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut *waiter)
        .await
        .unwrap();
    assert_eq!(setting, "7s");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM written_before")
        .fetch_one(&mut *waiter)
        .await
        .unwrap();
    assert_eq!(rows, 1);
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

/// PostgreSQL's `lock_timeout` is an int of milliseconds: a longer wait
/// was cut to about 24.8 days without a word, and its `LockTimeout` then
/// claimed to have waited what was asked. Bounded waits past
/// `lock::MAX_LOCK_TIMEOUT` are refused before any statement, by
/// `lock_timeout` and by a guard's config alike; the longest is taken.
#[tokio::test]
async fn a_lock_timeout_past_the_longest_is_refused_before_any_statement() {
    let pool = pool().await;
    let key = LockKey::new("entity", "longest wait").unwrap();
    let too_long = [Duration::MAX, Duration::from_millis(i32::MAX as u64 + 1)];
    for timeout in too_long {
        let mut tx = pool.begin().await.unwrap();
        let waited = lock::lock_timeout(&mut tx, key, timeout).await;
        assert!(matches!(waited, Err(Error::Invalid { .. })), "{waited:?}");
        // Nothing ran: the transaction is untouched and holds no lock.
        assert!(!held_by_anyone(&pool, key).await);
        tx.rollback().await.unwrap();
        let config = pgonce::GuardConfig {
            lock_timeout: Some(timeout),
            ..pgonce::GuardConfig::default()
        };
        let guard = pgonce::Guard::new("bounded", config);
        assert!(matches!(guard, Err(Error::Invalid { .. })), "{guard:?}");
    }
    let mut tx = pool.begin().await.unwrap();
    lock::lock_timeout(&mut tx, key, Duration::from_millis(i32::MAX as u64))
        .await
        .unwrap();
    assert!(held_by_anyone(&pool, key).await);
    tx.commit().await.unwrap();
}

/// A waiter's transaction, shared with the step that waits in it, so that
/// the transaction outlives the step's future when that is dropped.
type SharedTx = std::sync::Arc<tokio::sync::Mutex<sqlx::Transaction<'static, sqlx::Postgres>>>;

/// Starts a bounded wait for `key` in the waiter's transaction `tx` (on
/// session `waiter`), sees it blocked by `holder`, and gives it up as a
/// caller's own timeout or `select!` would: its future is dropped where it
/// waits, the wait still running on the server.
async fn give_up_a_bounded_wait(
    race: &Interleaving,
    waiter: &pgonce_testkit::Session,
    tx: &SharedTx,
    key: LockKey,
) {
    let in_step = tx.clone();
    let waiting = race
        .step_blocks(waiter, "bounded wait", async move {
            let mut tx = in_step.lock().await;
            lock::lock_timeout(&mut tx, key, Duration::from_secs(3)).await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["H"]);
    waiting.cancel();
}

/// The waiter's transaction, once the step given up has let go of it (its
/// task is dropped when the runtime gets to it, not at `cancel`).
async fn taken_back(tx: SharedTx) -> sqlx::Transaction<'static, sqlx::Postgres> {
    drop(tx.lock().await);
    std::sync::Arc::into_inner(tx)
        .expect("the step given up holds the transaction no more")
        .into_inner()
}

/// A bounded wait whose future is dropped mid-wait (a caller's own
/// timeout around it) must leave the caller's transaction as it was when
/// the wait then runs out on the server: usable, its earlier writes
/// committed by its COMMIT, the session's lock_timeout in force. Sent as
/// one message whose undo is a second one, the dropped call never sent
/// that undo: the transaction was left aborted, and its COMMIT rolled the
/// earlier writes back while reporting success.
#[tokio::test]
async fn a_bounded_wait_given_up_that_then_runs_out_leaves_the_transaction_as_it_was() {
    let db = fresh_database().await;
    let pool = db.pool(2).await.unwrap();
    sqlx::query("CREATE TABLE written_before (x int)")
        .execute(&pool)
        .await
        .unwrap();
    let race = Interleaving::new(db.options()).await.unwrap();
    let h = race.session("H").await.unwrap();
    let w = race.session("W").await.unwrap();
    let key = LockKey::new("entity", "given up, runs out").unwrap();
    let mut holder = h.pool().begin().await.unwrap();
    lock::lock(&mut holder, key).await.unwrap();

    let tx: SharedTx =
        std::sync::Arc::new(tokio::sync::Mutex::new(w.pool().begin().await.unwrap()));
    {
        let mut tx = tx.lock().await;
        sqlx::query("SET lock_timeout = '7s'")
            .execute(&mut **tx)
            .await
            .unwrap();
        sqlx::query("INSERT INTO written_before VALUES (1)")
            .execute(&mut **tx)
            .await
            .unwrap();
    }
    give_up_a_bounded_wait(&race, &w, &tx, key).await;

    // The holder keeps the lock throughout: the wait given up runs out on
    // the server before the waiter's next statement runs.
    let mut tx = taken_back(tx).await;
    let setting: Result<String, _> = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut *tx)
        .await;
    assert_eq!(
        setting
            .as_ref()
            .map_err(|e| e.to_string())
            .map(String::as_str),
        Ok("7s"),
        "the transaction is usable, the session's lock_timeout in force"
    );
    tx.commit().await.unwrap();
    holder.commit().await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM written_before")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "the write before the wait given up is committed");
}

/// `lock` and `lock_many` wait as long as it takes, whatever lock_timeout
/// the session inherited (an operator's `ALTER ROLE ... SET lock_timeout`;
/// here set on the session): each is still waiting at four times that
/// timeout, goes through once the holder commits, and leaves the session's
/// value in force for the statements after it. Inheriting it, `lock_many`
/// failed after 50 ms with PostgreSQL's 55P03 as a database error, its
/// transaction aborted.
#[tokio::test]
async fn lock_and_lock_many_wait_past_the_sessions_lock_timeout() {
    let db = fresh_database().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (h, w) = (
        race.session("H").await.unwrap(),
        race.session("W").await.unwrap(),
    );
    w.set("lock_timeout", "50ms").await.unwrap();
    let k1 = LockKey::new("entity", "inherited one").unwrap();
    let k2 = LockKey::new("entity", "inherited two").unwrap();

    for many in [false, true] {
        let mut holder = h.pool().begin().await.unwrap();
        race.step(&h, "lock two", lock::lock(&mut holder, k2))
            .await
            .unwrap()
            .unwrap();
        let pool_w = w.pool().clone();
        let waiting = race
            .step_blocks(&w, "lock", async move {
                let mut tx = pool_w.begin().await?;
                if many {
                    lock::lock_many(&mut tx, [k1, k2]).await?;
                } else {
                    lock::lock(&mut tx, k2).await?;
                }
                let after: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok::<_, Error>(after)
            })
            .await
            .unwrap();
        let after = waiting
            .outlasts_then_commit(200, &h, holder)
            .await
            .unwrap_or_else(|e| panic!("lock_many: {many}: {e}"))
            .unwrap();
        assert_eq!(after, "50ms", "lock_many: {many}");
    }
}

/// `statement_timeout` still bounds every wait, as the module docs say:
/// `lock`, `lock_many` and `lock_timeout` (with a longer bound of its own)
/// fail once it runs out with the typed `QueryCanceled` (SQLSTATE 57014),
/// not `LockTimeout` nor a bare database error. After `lock` and `lock_many` the caller's transaction is
/// aborted; `lock_timeout` waits in a savepoint, rolled back, so the
/// transaction goes on.
#[tokio::test]
async fn statement_timeout_still_bounds_every_wait() {
    let db = fresh_database().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (h, w) = (
        race.session("H").await.unwrap(),
        race.session("W").await.unwrap(),
    );
    w.set("statement_timeout", "100ms").await.unwrap();
    let key = LockKey::new("entity", "statement timeout").unwrap();
    let mut holder = h.pool().begin().await.unwrap();
    lock::lock(&mut holder, key).await.unwrap();
    for how in ["lock", "lock_many", "lock_timeout"] {
        let mut tx = w.pool().begin().await.unwrap();
        let waited = match how {
            "lock" => lock::lock(&mut tx, key).await,
            "lock_many" => lock::lock_many(&mut tx, [key]).await,
            _ => lock::lock_timeout(&mut tx, key, Duration::from_secs(60)).await,
        };
        let Err(Error::QueryCanceled { message }) = &waited else {
            panic!("{how}: {waited:?}");
        };
        assert!(message.contains("statement timeout"), "{how}: {message}");
        // Aborted, as by any statement it ends: only lock_timeout's own
        // bound is caught on the server and leaves the transaction usable.
        let after = sqlx::query("SELECT 1").execute(&mut *tx).await;
        assert!(after.is_err(), "{how}: {after:?}");
    }
}
