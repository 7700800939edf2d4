//! Dedupe against a real PostgreSQL: a counter increment applied once per
//! message id (also when two deliveries race), collection of old keys, and
//! idempotency keys (replay, mismatch, in-progress, recovery after the holder
//! died, fencing of the dead holder, collection).

mod support;

use std::time::Duration;

use pgonce::Error;
use pgonce::IsolationLevel;
use pgonce::dedupe::{self, Acquired, Collector, CollectorConfig, KeyHold};
use pgonce_testkit::{Interleaving, fresh_migrated_database};
use serde_json::json;
use sqlx::PgPool;
use support::incompressible;

async fn setup() -> (pgonce_testkit::ScratchDatabase, PgPool) {
    let (db, pool) = fresh_migrated_database(8, pgonce::migrate).await;
    sqlx::query("CREATE TABLE counter (id int PRIMARY KEY, n int NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO counter VALUES (1, 0)")
        .execute(&pool)
        .await
        .unwrap();
    (db, pool)
}

async fn counter(pool: &PgPool) -> i32 {
    sqlx::query_scalar("SELECT n FROM counter WHERE id = 1")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn bump(conn: &mut sqlx::PgConnection) -> pgonce::Result<()> {
    sqlx::query("UPDATE counter SET n = n + 1 WHERE id = 1")
        .execute(conn)
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_counter_increment_is_applied_once_per_message_id() {
    let (_db, pool) = setup().await;
    for _ in 0..3 {
        dedupe::apply_once(
            &pool,
            "billing",
            "msg-1",
            async |c: &mut sqlx::PgConnection| bump(c).await,
        )
        .await
        .unwrap();
    }
    let other = dedupe::apply_once(
        &pool,
        "billing",
        "msg-2",
        async |c: &mut sqlx::PgConnection| bump(c).await,
    )
    .await
    .unwrap();
    assert_eq!(other, Some(()));
    assert_eq!(counter(&pool).await, 2);
}

#[tokio::test]
async fn a_failed_effect_forgets_the_key_so_the_message_can_be_processed_again() {
    let (_db, pool) = setup().await;
    let failed = dedupe::apply_once(
        &pool,
        "billing",
        "msg-1",
        async |c: &mut sqlx::PgConnection| {
            bump(c).await?;
            Err::<(), _>(Error::Invalid {
                what: "effect",
                why: "remote call failed".into(),
            })
        },
    )
    .await;
    assert!(failed.is_err());
    assert_eq!(counter(&pool).await, 0);
    let again = dedupe::apply_once(
        &pool,
        "billing",
        "msg-1",
        async |c: &mut sqlx::PgConnection| bump(c).await,
    )
    .await
    .unwrap();
    assert_eq!(again, Some(()));
    assert_eq!(counter(&pool).await, 1);
}

/// A dedupe statement that meets a key another transaction is writing
/// waits for it within the session's lock_timeout (an operator's `ALTER
/// ROLE ... SET lock_timeout`; here set on the session): past it, the
/// typed `LockNotAvailable` with nothing written, not a bare database
/// error. Seen blocked on A's transaction first: a duplicate delivery's
/// mark behind the first delivery's, and a retried request's acquire
/// behind the holder's `finish`. Each gave PostgreSQL's 55P03 as
/// `Error::Database`. Once A commits, both see what A left.
#[tokio::test]
async fn a_wait_past_the_sessions_lock_timeout_is_typed_and_writes_nothing() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    b.set("lock_timeout", "1s").await.unwrap();
    let print = dedupe::fingerprint(&json!({"amount": 1})).unwrap();
    let Acquired::Process(hold) =
        dedupe::acquire(&pool, "api", "k", &print, Duration::from_secs(60))
            .await
            .unwrap()
    else {
        panic!("a new key is held");
    };
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(&a, "mark m", dedupe::mark_processed(&mut tx_a, "c", "m"))
        .await
        .unwrap()
        .unwrap();
    race.step(
        &a,
        "finish k",
        dedupe::finish(&mut *tx_a, &hold, &json!("ok")),
    )
    .await
    .unwrap()
    .unwrap();
    for case in ["mark_processed", "acquire"] {
        let timeout = ("lock_timeout", Duration::from_secs(1));
        let waited = support::outcome_of_blocked_wait(&race, &b, "A", case, timeout, || {
            let pool_b = b.pool().clone();
            let print = print.clone();
            async move {
                if case == "acquire" {
                    return dedupe::acquire(&pool_b, "api", "k", &print, Duration::from_secs(60))
                        .await
                        .map(drop);
                }
                let mut tx = pgonce::begin(&pool_b, IsolationLevel::ReadCommitted).await?;
                dedupe::mark_processed(&mut tx, "c", "m").await.map(drop)
            }
        })
        .await;
        assert!(
            matches!(&waited, Err(Error::LockNotAvailable { .. })),
            "{case}: {waited:?}"
        );
    }
    race.step(&a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    let mut tx = pgonce::begin(b.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    assert!(!dedupe::mark_processed(&mut tx, "c", "m").await.unwrap());
    tx.rollback().await.unwrap();
    let again = dedupe::acquire(b.pool(), "api", "k", &print, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(again, Acquired::Replay(json!("ok")));
}

/// `apply_once` given up after its mark, while its effect waits for a row
/// another transaction holds: the mark and the effect are one
/// transaction, rolled back when the call is dropped. Neither is left:
/// the message's redelivery applies the effect, once.
#[tokio::test]
async fn an_apply_once_dropped_during_its_effect_leaves_neither_mark_nor_effect() {
    let (db, pool) = setup().await;
    let support::HolderAndWaiter { race, a, b, tx_a } = support::a_holding(
        db.options(),
        "lock the counter",
        "SELECT 1 FROM counter WHERE id = 1 FOR UPDATE",
    )
    .await;
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "apply_once", async move {
            dedupe::apply_once(
                &pool_b,
                "billing",
                "msg-1",
                async |c: &mut sqlx::PgConnection| bump(c).await,
            )
            .await
        })
        .await
        .unwrap();
    support::give_up_then_end(&race, waiting, (&a, tx_a.commit()), &b).await;

    assert_eq!(counter(&pool).await, 0, "the effect was rolled back");
    let redelivery = dedupe::apply_once(
        b.pool(),
        "billing",
        "msg-1",
        async |c: &mut sqlx::PgConnection| bump(c).await,
    )
    .await
    .unwrap();
    assert_eq!(redelivery, Some(()), "the mark was rolled back too");
    assert_eq!(counter(&pool).await, 1);
}

#[tokio::test]
async fn two_concurrent_deliveries_of_one_message_bump_the_counter_once() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    let first = race
        .step(
            &a,
            "mark msg-1",
            dedupe::mark_processed(&mut tx_a, "c", "msg-1"),
        )
        .await
        .unwrap()
        .unwrap();
    assert!(first);
    race.step(&a, "bump", bump(&mut tx_a))
        .await
        .unwrap()
        .unwrap();
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "mark msg-1", async move {
            let mut tx = pgonce::begin(&pool_b, IsolationLevel::ReadCommitted).await?;
            let first = dedupe::mark_processed(&mut tx, "c", "msg-1").await?;
            if first {
                bump(&mut tx).await?;
            }
            tx.commit().await?;
            Ok::<bool, Error>(first)
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    race.step(&a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    let b_first = waiting.resume().await.unwrap().unwrap();
    assert!(!b_first, "B saw the key A committed");
    assert_eq!(counter(&pool).await, 1);
}

#[tokio::test]
async fn old_processed_keys_and_idempotency_keys_are_collected_and_recent_ones_kept() {
    let (_db, pool) = setup().await;
    for id in ["old", "new"] {
        dedupe::apply_once(&pool, "c", id, async |c: &mut sqlx::PgConnection| {
            bump(c).await
        })
        .await
        .unwrap();
    }
    sqlx::query("UPDATE pgonce.processed_messages SET processed_at = now() - interval '8 days' WHERE message_id = 'old'")
        .execute(&pool)
        .await
        .unwrap();
    let fp = dedupe::fingerprint(&json!({"a": 1})).unwrap();
    for key in ["k-old", "k-new", "k-old-held"] {
        let Acquired::Process(hold) =
            dedupe::acquire(&pool, "api", key, &fp, Duration::from_secs(60))
                .await
                .unwrap()
        else {
            panic!("new key");
        };
        if key != "k-old-held" {
            dedupe::finish(&pool, &hold, &json!({"ok": key}))
                .await
                .unwrap();
        }
    }
    sqlx::query("UPDATE pgonce.idempotency_keys SET created_at = now() - interval '2 days' WHERE key IN ('k-old', 'k-old-held')")
        .execute(&pool)
        .await
        .unwrap();
    let config = CollectorConfig {
        batch_size: 1,
        ..CollectorConfig::default()
    };
    let counts = Collector::new(pool.clone(), config)
        .unwrap()
        .run_once()
        .await
        .unwrap();
    assert_eq!(counts.processed_messages, 1);
    assert_eq!(counts.idempotency_keys, 1, "a live hold is not collected");
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT key FROM pgonce.idempotency_keys ORDER BY key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(keys, ["k-new", "k-old-held"]);
    let ids: Vec<String> = sqlx::query_scalar("SELECT message_id FROM pgonce.processed_messages")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ids, ["new"]);
}

#[tokio::test]
async fn an_idempotency_key_replays_the_stored_response_and_rejects_another_request() {
    let (_db, pool) = setup().await;
    let request = json!({"amount": 10, "to": "acct-1"});
    let fp = dedupe::fingerprint(&request).unwrap();
    let hold = match dedupe::acquire(&pool, "payments", "key-1", &fp, Duration::from_secs(60))
        .await
        .unwrap()
    {
        Acquired::Process(hold) => hold,
        other => panic!("{other:?}"),
    };
    assert!(hold.first_use);
    // While the first request is in progress, a retry is told to wait.
    assert!(matches!(
        dedupe::acquire(&pool, "payments", "key-1", &fp, Duration::from_secs(60)).await,
        Err(Error::IdempotencyInProgress { .. })
    ));
    // The effect and the stored response commit together.
    let mut tx = pool.begin().await.unwrap();
    bump(&mut tx).await.unwrap();
    // A response that could not be replayed (nested deeper than can be
    // read back, or holding a NUL) is refused before it is written.
    let mut too_deep = json!(1);
    for _ in 0..=pgonce::json::MAX_JSON_NESTING {
        too_deep = json!([too_deep]);
    }
    for bad in [too_deep, json!({"charge": "ch\u{0}1"})] {
        assert!(matches!(
            dedupe::finish(&mut *tx, &hold, &bad).await,
            Err(Error::Invalid { .. })
        ));
    }
    dedupe::finish(&mut *tx, &hold, &json!({"charge": "ch_1"}))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let replay = dedupe::acquire(&pool, "payments", "key-1", &fp, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(replay, Acquired::Replay(json!({"charge": "ch_1"})));
    let other = dedupe::fingerprint(&json!({"amount": 99, "to": "acct-1"})).unwrap();
    let mismatch =
        dedupe::acquire(&pool, "payments", "key-1", &other, Duration::from_secs(60)).await;
    assert!(
        matches!(mismatch, Err(Error::IdempotencyMismatch { .. })),
        "{mismatch:?}"
    );
    // The same key in another scope is another key.
    assert!(matches!(
        dedupe::acquire(&pool, "refunds", "key-1", &other, Duration::from_secs(60)).await,
        Ok(Acquired::Process(_))
    ));
    assert_eq!(counter(&pool).await, 1);
    let stored: serde_json::Value = sqlx::query_scalar(
        "SELECT response FROM pgonce.idempotency_keys WHERE scope = 'payments' AND key = 'key-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        stored,
        json!({"charge": "ch_1"}),
        "the mismatch wrote nothing"
    );
}

/// A request is a value: the same body with its object keys in another
/// order (another client library, a proxy that parses and re-serialises,
/// a `HashMap` in another process) is the same request, and its retry
/// gets the stored response. Its fingerprint was taken over the bytes as
/// serde_json wrote them, in the order the map gave its keys (the
/// workspace's serde_json keeps insertion order), so the retry was refused
/// as another request. A body that differs in a value is still refused.
#[tokio::test]
async fn a_retry_with_the_same_body_in_another_key_order_is_replayed() {
    let (_db, pool) = setup().await;
    let parse = |body: &str| serde_json::from_str::<serde_json::Value>(body).unwrap();
    let first = parse(r#"{"amount": 10, "to": {"bank": "b", "account": "acct-1"}}"#);
    let reordered = parse(r#"{"to": {"account": "acct-1", "bank": "b"}, "amount": 10}"#);
    let other = parse(r#"{"to": {"account": "acct-2", "bank": "b"}, "amount": 10}"#);
    let request = async |body: &serde_json::Value| {
        let fp = dedupe::fingerprint(body).unwrap();
        dedupe::acquire(&pool, "payments", "key-1", &fp, Duration::from_secs(60)).await
    };
    let Ok(Acquired::Process(hold)) = request(&first).await else {
        panic!("the first use is not a hold");
    };
    dedupe::finish(&pool, &hold, &json!({"charge": "ch_1"}))
        .await
        .unwrap();
    let retry = request(&reordered).await;
    assert!(
        matches!(&retry, Ok(Acquired::Replay(r)) if *r == json!({"charge": "ch_1"})),
        "{retry:?}"
    );
    let mismatch = request(&other).await;
    assert!(
        matches!(mismatch, Err(Error::IdempotencyMismatch { .. })),
        "{mismatch:?}"
    );
}

/// A replay is the response as it was given: the same value, and the same
/// JSON text once serialised (what a service sends back to the client).
/// Stored as `jsonb`, it was not: jsonb keeps numbers as decimals and
/// objects in an order of its own, so a float of 1e16 or more came back
/// as an integer (another `Value`), -0.0 as 0.0, and an object's keys
/// sorted by length, while the first caller had sent them as built.
/// Large, deep, escaped and non-BMP values must come back equal too.
#[tokio::test]
async fn a_replay_is_the_first_response_value_for_value_and_byte_for_byte() {
    let (_db, pool) = setup().await;
    let mut deepest = json!("bottom");
    for _ in 0..pgonce::json::MAX_JSON_NESTING {
        deepest = json!([deepest]);
    }
    let responses = [
        ("a float past 1e16", json!({"amount": 1e16, "rate": 2.5e18})),
        ("the largest float", json!(f64::MAX)),
        ("negative zero", json!({"delta": -0.0})),
        ("a float with an exponent", json!({"tiny": 1.5e-7})),
        (
            "the ends of the integers",
            json!({"max": u64::MAX, "min": i64::MIN}),
        ),
        (
            "keys in the order they were built",
            json!({"zeta": 1, "alpha": 2, "mid": {"b": 1, "a": 2}}),
        ),
        (
            "escapes and non-BMP text",
            json!({"text": "quote \" backslash \\ tab \t nl \n \u{1F600} \u{7f} \u{2028}"}),
        ),
        ("nested as deep as reads back", deepest),
        (
            "a large body",
            json!({"blob": incompressible(2_000_000), "list": (0..10_000).collect::<Vec<i32>>()}),
        ),
        ("null", json!(null)),
    ];
    let mut differ = Vec::new();
    for (n, (what, response)) in responses.iter().enumerate() {
        let key = format!("key-{n}");
        let fp = dedupe::fingerprint(&json!({ "request": n })).unwrap();
        let Acquired::Process(hold) =
            dedupe::acquire(&pool, "awkward", &key, &fp, Duration::from_secs(60))
                .await
                .unwrap()
        else {
            panic!("{what}: the first use is not a hold");
        };
        dedupe::finish(&pool, &hold, response).await.unwrap();
        let replay = dedupe::acquire(&pool, "awkward", &key, &fp, Duration::from_secs(60))
            .await
            .unwrap();
        let Acquired::Replay(replayed) = replay else {
            panic!("{what}: {replay:?}");
        };
        let (given, got) = (
            serde_json::to_string(response).unwrap(),
            serde_json::to_string(&replayed).unwrap(),
        );
        if &replayed != response || got != given {
            differ.push(format!(
                "{what}: equal values {}, given {given:.80}, replayed {got:.80}",
                &replayed == response
            ));
        }
    }
    assert!(differ.is_empty(), "{differ:#?}");
}

#[tokio::test]
async fn a_key_whose_holder_died_is_recovered_after_its_hold_expires_and_the_dead_holder_is_fenced()
{
    let (_db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let dead = held_past_its_hold(&pool, "k", &fp).await;
    let other = dedupe::fingerprint(&json!("other")).unwrap();
    assert!(
        matches!(
            dedupe::acquire(&pool, "api", "k", &other, Duration::from_secs(60)).await,
            Err(Error::IdempotencyMismatch { .. })
        ),
        "recovery is only for the same request"
    );
    let Acquired::Process(new) = dedupe::acquire(&pool, "api", "k", &fp, Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("recovered");
    };
    assert!(!new.first_use);
    assert_ne!(new.token, dead.token);
    assert!(matches!(
        dedupe::finish(&pool, &dead, &json!("late")).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        dedupe::release(&pool, &dead).await,
        Err(Error::LeaseLost { .. })
    ));
    dedupe::finish(&pool, &new, &json!("fresh")).await.unwrap();
    assert_eq!(
        dedupe::acquire(&pool, "api", "k", &fp, Duration::from_secs(60))
            .await
            .unwrap(),
        Acquired::Replay(json!("fresh"))
    );
}

#[tokio::test]
async fn a_released_key_starts_afresh_and_bad_input_is_rejected() {
    let (_db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!(1)).unwrap();
    let Acquired::Process(hold) = dedupe::acquire(&pool, "api", "k", &fp, Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!()
    };
    dedupe::release(&pool, &hold).await.unwrap();
    assert!(matches!(
        dedupe::acquire(&pool, "api", "k", &fp, Duration::from_secs(60)).await,
        Ok(Acquired::Process(h)) if h.first_use
    ));
    assert!(matches!(
        dedupe::acquire(&pool, "", "k", &fp, Duration::from_secs(60)).await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        dedupe::acquire(&pool, "api", "k2", &fp, Duration::ZERO).await,
        Err(Error::Invalid { .. })
    ));
    let too_long = pgonce::maintenance::MAX_RETENTION + Duration::from_secs(1);
    for config in [
        CollectorConfig {
            key_retention: too_long,
            ..CollectorConfig::default()
        },
        CollectorConfig {
            processed_retention: too_long,
            ..CollectorConfig::default()
        },
    ] {
        assert!(matches!(
            Collector::new(pool.clone(), config),
            Err(Error::Invalid { .. })
        ));
    }
    let mut tx = pool.begin().await.unwrap();
    assert!(matches!(
        dedupe::mark_processed(&mut tx, "c", "").await,
        Err(Error::Invalid { .. })
    ));
    drop(tx);
    let n: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pgonce.idempotency_keys WHERE key = 'k2') + (SELECT count(*) FROM pgonce.processed_messages)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(n, 0);
}

/// A hold's end is read back after the key is stored, and a timestamp past
/// year 9999 cannot be: a longer hold would leave the key in progress for
/// every retry. Holds past `dedupe::MAX_HOLD` are refused and store
/// nothing; `MAX_HOLD` itself reads back.
#[tokio::test]
async fn a_hold_longer_than_the_longest_is_refused_and_stores_nothing() {
    let (_db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!({"pay": 1})).unwrap();
    for hold_for in [
        dedupe::MAX_HOLD + Duration::from_secs(1),
        Duration::from_secs(8_000 * 365 * 24 * 3600),
    ] {
        assert!(matches!(
            dedupe::acquire(&pool, "api", "k", &fp, hold_for).await,
            Err(Error::Invalid { .. })
        ));
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    let Acquired::Process(hold) = dedupe::acquire(&pool, "api", "k", &fp, dedupe::MAX_HOLD)
        .await
        .unwrap()
    else {
        panic!("a new key is processed")
    };
    dedupe::finish(&pool, &hold, &json!({"paid": true}))
        .await
        .unwrap();
    assert!(matches!(
        dedupe::acquire(&pool, "api", "k", &fp, Duration::from_secs(60)).await,
        Ok(Acquired::Replay(response)) if response == json!({"paid": true})
    ));
}

/// A hold shorter than half a microsecond rounds to zero in PostgreSQL's
/// `interval`: the key was taken with a hold over as it was taken, and the
/// next identical request took it over while the first still worked on
/// it. Holds below `dedupe::MIN_HOLD` are refused and store nothing;
/// `MIN_HOLD` itself ends after the key is taken.
#[tokio::test]
async fn a_hold_shorter_than_the_shortest_is_refused_and_stores_nothing() {
    let (_db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!({"pay": 1})).unwrap();
    for hold_for in [
        Duration::from_nanos(1),
        Duration::from_nanos(400),
        Duration::from_micros(999),
    ] {
        let acquired = dedupe::acquire(&pool, "api", "k", &fp, hold_for).await;
        if acquired.is_ok() {
            let over: bool = sqlx::query_scalar(
                "SELECT held_until < now() FROM pgonce.idempotency_keys WHERE key = 'k'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            panic!("a hold of {hold_for:?} was taken; run out by the next statement: {over}");
        }
        assert!(
            matches!(acquired, Err(Error::Invalid { .. })),
            "{acquired:?}"
        );
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    let acquired = dedupe::acquire(&pool, "api", "k", &fp, Duration::from_millis(1))
        .await
        .unwrap();
    assert!(matches!(acquired, Acquired::Process(_)), "{acquired:?}");
    let lasts: bool = sqlx::query_scalar(
        "SELECT held_until >= created_at + interval '1 ms' FROM pgonce.idempotency_keys \
         WHERE key = 'k'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(lasts);
}

#[tokio::test]
async fn under_repeatable_read_the_waiting_duplicate_gets_40001_and_its_retry_skips() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(&a, "mark m", dedupe::mark_processed(&mut tx_a, "c", "m"))
        .await
        .unwrap()
        .unwrap();
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "mark m under REPEATABLE READ", async move {
            let mut tx = pgonce::begin(&pool_b, IsolationLevel::RepeatableRead).await?;
            let out = dedupe::mark_processed(&mut tx, "c", "m").await;
            let _ = tx.rollback().await;
            out
        })
        .await
        .unwrap();
    race.step(&a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    let first = waiting.resume().await.unwrap();
    assert!(matches!(&first, Err(e) if e.is_retryable()), "{first:?}");
    let mut tx = pgonce::begin(&pool, IsolationLevel::RepeatableRead)
        .await
        .unwrap();
    assert!(!dedupe::mark_processed(&mut tx, "c", "m").await.unwrap());
}

/// Starts the transaction's snapshot: the first statement of a REPEATABLE
/// READ or SERIALIZABLE transaction takes the snapshot every later one reads.
async fn take_snapshot(tx: &mut sqlx::PgConnection) {
    sqlx::query("SELECT count(*) FROM pgonce.idempotency_keys")
        .execute(tx)
        .await
        .unwrap();
}

/// A handler whose REPEATABLE READ or SERIALIZABLE transaction began (and
/// took its snapshot) before it acquired the key holds the key all the
/// same: finishing in that transaction cannot see the hold, and must ask
/// for the transaction to be retried, not report the hold lost (the
/// handler would then give the request up while its key stays held by
/// nobody until the hold expires). The retry, under a fresh snapshot,
/// finishes under the same hold. Both on a new key and on one recovered
/// from a dead holder (the snapshot then sees the dead holder's token).
#[tokio::test]
async fn a_hold_finished_under_a_snapshot_older_than_the_hold_asks_for_a_retry() {
    let (_db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let hold_for = Duration::from_secs(60);
    for (n, level) in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable]
        .into_iter()
        .enumerate()
    {
        for recovered in [false, true] {
            let key = format!("k-{level:?}-{recovered}");
            if recovered {
                held_past_its_hold(&pool, &key, &fp).await;
            }
            let mut tx = pgonce::begin(&pool, level).await.unwrap();
            take_snapshot(&mut tx).await;
            let mut tx_release = pgonce::begin(&pool, level).await.unwrap();
            take_snapshot(&mut tx_release).await;
            let Acquired::Process(hold) = dedupe::acquire(&pool, "api", &key, &fp, hold_for)
                .await
                .unwrap()
            else {
                panic!("the key is free");
            };
            assert_eq!(hold.first_use, !recovered);
            bump(&mut tx).await.unwrap();
            let stale = dedupe::finish(&mut *tx, &hold, &json!("r")).await;
            assert!(
                matches!(&stale, Err(e @ Error::SerializationFailure { .. }) if e.is_retryable()),
                "{level:?}, recovered {recovered}: {stale:?}"
            );
            let _ = tx.rollback().await;
            let stale = dedupe::release(&mut *tx_release, &hold).await;
            assert!(
                matches!(&stale, Err(e @ Error::SerializationFailure { .. }) if e.is_retryable()),
                "release, {level:?}, recovered {recovered}: {stale:?}"
            );
            let _ = tx_release.rollback().await;
            // The retry: a fresh snapshot sees the hold.
            let mut tx = pgonce::begin(&pool, level).await.unwrap();
            bump(&mut tx).await.unwrap();
            dedupe::finish(&mut *tx, &hold, &json!("r")).await.unwrap();
            tx.commit().await.unwrap();
            assert_eq!(
                dedupe::acquire(&pool, "api", &key, &fp, hold_for)
                    .await
                    .unwrap(),
                Acquired::Replay(json!("r"))
            );
            assert_eq!(
                counter(&pool).await,
                (2 * n + usize::from(recovered) + 1) as i32
            );
        }
    }
}

/// A hold that really was lost stays [`Error::LeaseLost`] under any
/// isolation level, however often the transaction is retried: the check
/// that tells a stale snapshot from a lost hold must not turn a lost hold
/// into an endless retry.
#[tokio::test]
async fn a_hold_taken_over_is_lost_under_repeatable_read_too() {
    let (_db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let hold_for = Duration::from_secs(60);
    let dead = held_past_its_hold(&pool, "k", &fp).await;
    let Acquired::Process(_new) = dedupe::acquire(&pool, "api", "k", &fp, hold_for)
        .await
        .unwrap()
    else {
        panic!("recovered");
    };
    for level in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable] {
        let mut tx = pgonce::begin(&pool, level).await.unwrap();
        take_snapshot(&mut tx).await;
        let lost = dedupe::finish(&mut *tx, &dead, &json!("late")).await;
        assert!(matches!(lost, Err(Error::LeaseLost { .. })), "{lost:?}");
        let lost = dedupe::release(&mut *tx, &dead).await;
        assert!(matches!(lost, Err(Error::LeaseLost { .. })), "{lost:?}");
        tx.rollback().await.unwrap();
    }
}

/// A key PostgreSQL cannot store (a NUL character; longer than one entry of
/// the key's unique index holds, whatever it compresses to) is refused
/// before anything reaches the database: inside the caller's transaction a
/// database error would abort it, effects and all. A key of the longest
/// allowed length, in a scope as long, is stored.
#[tokio::test]
async fn keys_with_nul_or_past_the_longest_are_refused_before_the_transaction_is_touched() {
    let (_db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!(1)).unwrap();
    let hold_for = Duration::from_secs(60);
    let longest = incompressible(dedupe::MAX_KEY_BYTES);
    let too_long = incompressible(dedupe::MAX_KEY_BYTES + 1);
    let mut tx = pool.begin().await.unwrap();
    for (consumer, message_id) in [
        ("c", "a\0b"),
        ("c\0", "m"),
        ("c", too_long.as_str()),
        (too_long.as_str(), "m"),
    ] {
        let out = dedupe::mark_processed(&mut tx, consumer, message_id).await;
        assert!(matches!(out, Err(Error::Invalid { .. })), "{out:?}");
    }
    assert!(
        dedupe::mark_processed(&mut tx, &longest, &longest)
            .await
            .unwrap(),
        "the transaction is intact and the longest key fits"
    );
    tx.commit().await.unwrap();
    for (scope, key) in [
        ("s", "a\0b"),
        ("s\0", "k"),
        ("s", too_long.as_str()),
        (too_long.as_str(), "k"),
    ] {
        let out = dedupe::acquire(&pool, scope, key, &fp, hold_for).await;
        assert!(matches!(out, Err(Error::Invalid { .. })), "{out:?}");
    }
    let Acquired::Process(hold) = dedupe::acquire(&pool, &longest, &longest, &fp, hold_for)
        .await
        .unwrap()
    else {
        panic!("new key");
    };
    dedupe::finish(&pool, &hold, &json!("ok")).await.unwrap();
}

/// Takes new key `key` of scope `api` and makes its hold run out, as if its
/// holder had died or stalled; returns that hold.
async fn held_past_its_hold(pool: &PgPool, key: &str, fp: &[u8]) -> KeyHold {
    let Acquired::Process(hold) = dedupe::acquire(pool, "api", key, fp, Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("new key");
    };
    sqlx::query(
        "UPDATE pgonce.idempotency_keys SET held_until = now() - interval '1 ms' \
         WHERE key = $1",
    )
    .bind(key)
    .execute(pool)
    .await
    .unwrap();
    hold
}

/// Two holders of one key across the hold's expiry, the first finishing
/// while the second arrives: the second waits for the first's finish, then
/// replays its response if it committed, or takes the key over if it rolled
/// back. Never both processing, never a response lost.
#[tokio::test]
async fn a_late_finish_racing_a_takeover_is_replayed_if_it_commits_and_taken_over_if_not() {
    let (db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let hold_for = Duration::from_secs(60);
    for commit in [true, false] {
        let key = format!("k-{commit}");
        let first = held_past_its_hold(&pool, &key, &fp).await;
        let race = Interleaving::new(db.options()).await.unwrap();
        let a = race.session("A").await.unwrap();
        let b = race.session("B").await.unwrap();
        let mut tx_a = a.pool().begin().await.unwrap();
        race.step(
            &a,
            "finish after the hold expired",
            dedupe::finish(&mut *tx_a, &first, &json!("first")),
        )
        .await
        .unwrap()
        .unwrap();
        let pool_b = b.pool().clone();
        let (key_b, fp_b) = (key.clone(), fp.clone());
        let waiting = race
            .step_blocks(&b, "acquire", async move {
                dedupe::acquire(&pool_b, "api", &key_b, &fp_b, hold_for).await
            })
            .await
            .unwrap();
        assert_eq!(waiting.blocked_by(), ["A"]);
        if commit {
            race.step(&a, "COMMIT", tx_a.commit())
                .await
                .unwrap()
                .unwrap();
            let out = waiting.resume().await.unwrap().unwrap();
            assert_eq!(out, Acquired::Replay(json!("first")));
        } else {
            race.step(&a, "ROLLBACK", tx_a.rollback())
                .await
                .unwrap()
                .unwrap();
            let Acquired::Process(second) = waiting.resume().await.unwrap().unwrap() else {
                panic!("the key is free again");
            };
            assert!(!second.first_use);
            let late = dedupe::finish(&pool, &first, &json!("first")).await;
            assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
            dedupe::finish(&pool, &second, &json!("second"))
                .await
                .unwrap();
        }
    }
}

/// An acquire given up (a request timeout, a client gone) while its upsert
/// waits for another transaction writing the key. The upsert was sent: the
/// server runs it once that transaction ends, and commits a hold nobody has
/// the token of. Left, that hold turned every retry of the request away as
/// in progress for the hold's whole length. The hold must be given back,
/// before the connection serves anyone else, and the connection come back
/// outside any transaction.
#[tokio::test]
async fn an_acquire_dropped_while_it_waits_leaves_no_hold_behind() {
    let (db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let hold_for = Duration::from_secs(3600);
    let Acquired::Process(first) = dedupe::acquire(&pool, "api", "k", &fp, hold_for)
        .await
        .unwrap()
    else {
        panic!("a new key is held");
    };
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    // A gives the key up in a transaction it keeps open: B's upsert waits
    // for it, then inserts the key anew.
    let mut tx_a = a.pool().begin().await.unwrap();
    race.try_step(&a, "release", dedupe::release(&mut *tx_a, &first))
        .await
        .unwrap();
    let pool_b = b.pool().clone();
    let fp_b = fp.clone();
    let waiting = race
        .step_blocks(&b, "acquire", async move {
            dedupe::acquire(&pool_b, "api", "k", &fp_b, hold_for).await
        })
        .await
        .unwrap();
    support::give_up_then_end(&race, waiting, (&a, tx_a.commit()), &b).await;
    let retry = race
        .step(
            &b,
            "retry",
            dedupe::acquire(b.pool(), "api", "k", &fp, hold_for),
        )
        .await
        .unwrap();
    let Ok(Acquired::Process(hold)) = retry else {
        panic!("the retry of a request given up is processed, got {retry:?}");
    };
    assert!(
        hold.first_use,
        "the given-up hold was released, not taken over"
    );
    dedupe::finish(&pool, &hold, &json!("done")).await.unwrap();
}

/// An acquire given up while it waits for a pooled connection (the pool
/// exhausted, the client's own timeout run out) must not take the key once
/// a connection is free: nobody would use that hold, and until it was
/// given back the client's retry would be turned away as in progress. It
/// writes nothing. Every write to the key table is logged by a trigger, so
/// a hold taken and given back shows too.
#[tokio::test]
async fn an_acquire_dropped_while_it_waits_for_a_connection_writes_nothing() {
    let (db, pool) = setup().await;
    sqlx::raw_sql(
        "CREATE TABLE key_writes (key text NOT NULL); \
         CREATE FUNCTION log_key_write() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN INSERT INTO key_writes VALUES (NEW.key); RETURN NULL; END $$; \
         CREATE TRIGGER log_key_write AFTER INSERT OR UPDATE ON pgonce.idempotency_keys \
         FOR EACH ROW EXECUTE FUNCTION log_key_write();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let pool_of_one = db.pool(1).await.unwrap();
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let held = pool_of_one.acquire().await.unwrap();
    {
        let acquire = dedupe::acquire(&pool_of_one, "api", "k", &fp, Duration::from_secs(60));
        tokio::pin!(acquire);
        assert!(futures::poll!(acquire.as_mut()).is_pending());
        // Let it reach the pool's queue before it is given up.
        for _ in 0..10 {
            tokio::task::yield_now().await;
            assert!(futures::poll!(acquire.as_mut()).is_pending());
        }
    }
    drop(held);

    // The pool's one connection, once the given-up acquire is done with it.
    assert_eq!(
        support::leftovers(&pool_of_one).await,
        support::Leftovers::NONE
    );
    let writes: i64 = sqlx::query_scalar("SELECT count(*) FROM key_writes")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(writes, 0, "the given-up acquire wrote to the key table");
}

/// Waits until `acquire`, running as `session`, has either returned or is
/// seen waiting on `gate` alone, its next statement queued behind the
/// gate's lock: `true` for the latter.
async fn waits_on_gate<T>(
    race: &Interleaving,
    session: &pgonce_testkit::Session,
    gate: &pgonce_testkit::Session,
    acquiring: &tokio::task::JoinHandle<T>,
) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if acquiring.is_finished() {
            return false;
        }
        if race.blockers_of(session).await.unwrap() == Some(vec![gate.name().to_string()]) {
            return true;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "acquire neither returned nor waited on {}",
            gate.name()
        );
        // Polling the server for a state to appear, as the harness does.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Takes the key table's ACCESS EXCLUSIVE lock in a transaction of its own.
async fn lock_key_table(
    pool: PgPool,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("LOCK TABLE pgonce.idempotency_keys IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

/// `acquire` upserts the key and, when that takes nothing, reads it to say
/// why. Run as two statements on their own, the key could be collected
/// between them: the read found nothing, and after two such rounds
/// `acquire` answered `IdempotencyInProgress` for a key that was never in
/// progress. Driven step by step: before each of acquire's statements a
/// gate holding the key table's ACCESS EXCLUSIVE lock is queued behind it,
/// so that acquire's next statement waits on that gate, which meanwhile
/// collects the key, makes it again (done, as a retry finished it) and
/// collects it again. The key is never in progress: the right answers are
/// a replay of a response it had, or the key taken anew once collected.
#[tokio::test]
async fn a_key_collected_and_made_again_between_acquires_statements_is_never_in_progress() {
    let (db, pool) = setup().await;
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let hold_for = Duration::from_secs(60);
    let Acquired::Process(hold) = dedupe::acquire(&pool, "api", "k", &fp, hold_for)
        .await
        .unwrap()
    else {
        panic!("new key");
    };
    dedupe::finish(&pool, &hold, &json!("first")).await.unwrap();

    let race = Interleaving::new(db.options()).await.unwrap();
    let session = race.session("acquire").await.unwrap();
    let gates = [
        race.session("G1").await.unwrap(),
        race.session("G2").await.unwrap(),
    ];
    // Prepares acquire's statements on its connection first: preparing
    // takes the table's lock as well, and would be one more wait.
    for _ in 0..2 {
        dedupe::acquire(session.pool(), "api", "warm-up", &fp, hold_for)
            .await
            .unwrap_or_else(|e| {
                assert!(matches!(e, Error::IdempotencyInProgress { .. }), "{e:?}");
                Acquired::Replay(json!(null))
            });
    }

    let mut held = Some(
        race.try_step(
            &gates[0],
            "LOCK TABLE",
            lock_key_table(gates[0].pool().clone()),
        )
        .await
        .unwrap(),
    );
    let acquiring = tokio::spawn({
        let (pool, fp) = (session.pool().clone(), fp.clone());
        async move { dedupe::acquire(&pool, "api", "k", &fp, hold_for).await }
    });
    assert!(waits_on_gate(&race, &session, &gates[0], &acquiring).await);
    let collect = "DELETE FROM pgonce.idempotency_keys \
                   WHERE scope = 'api' AND key = 'k' AND fingerprint = $1";
    let make_again = "INSERT INTO pgonce.idempotency_keys \
                      (scope, key, fingerprint, status, response, finished_at) \
                      VALUES ('api', 'k', $1, 'done', '\"second\"', now())";
    let mut holder = 0;
    for change in [collect, make_again, collect] {
        let next = 1 - holder;
        let queued = race
            .step_blocks(
                &gates[next],
                "LOCK TABLE",
                lock_key_table(gates[next].pool().clone()),
            )
            .await
            .unwrap();
        let tx = held.take().expect("a gate holds the table");
        race.try_step(&gates[holder], "COMMIT", tx.commit())
            .await
            .unwrap();
        // Granted once acquire's statement has ended.
        let mut tx = queued.try_resume().await.unwrap();
        holder = next;
        let waits = waits_on_gate(&race, &session, &gates[holder], &acquiring).await;
        if waits {
            let changed = sqlx::query(change).bind(&fp).execute(&mut *tx);
            let changed = race
                .try_step(&gates[holder], change, changed)
                .await
                .unwrap();
            assert_eq!(changed.rows_affected(), 1);
        }
        held = Some(tx);
        if !waits {
            break;
        }
    }
    let tx = held.take().expect("a gate holds the table");
    race.try_step(&gates[holder], "COMMIT", tx.commit())
        .await
        .unwrap();
    // Whatever it found, never "in progress": nobody held the key. (The
    // key collected before its transaction took it: processed anew.)
    let out = acquiring.await.unwrap();
    assert!(
        matches!(&out, Ok(Acquired::Replay(r)) if *r == json!("first") || *r == json!("second"))
            || matches!(&out, Ok(Acquired::Process(_))),
        "{out:?}"
    );
}

/// A hold naming a transaction the server has not reached (its acquire
/// committed with `synchronous_commit = off` and lost in a crash, or the
/// hold rebuilt with a wrong id) is lost: finish and release are told so
/// at once. They were asked to retry (40001), and every retry again, until
/// the server's counter passed that id.
#[tokio::test]
async fn a_hold_from_a_transaction_the_server_has_not_reached_is_lost_not_retried() {
    let (_db, pool) = setup().await;
    let next = support::next_xid(&pool).await;
    let hold = KeyHold {
        scope: "api".into(),
        key: "k".into(),
        token: uuid::Uuid::new_v4(),
        held_until: time::OffsetDateTime::now_utc(),
        first_use: true,
        acquired_in: next + 1_000_000,
    };
    let out = dedupe::finish(&pool, &hold, &json!("done")).await;
    assert!(
        matches!(out, Err(Error::LeaseLost { .. })),
        "finish: {out:?}"
    );
    let out = dedupe::release(&pool, &hold).await;
    assert!(
        matches!(out, Err(Error::LeaseLost { .. })),
        "release: {out:?}"
    );
}

/// `acquire` tries its upsert alone first, on the pool: a transaction of
/// its own at the database's default isolation level. Under a stricter
/// default (`ALTER DATABASE ... SET default_transaction_isolation`) an
/// upsert that waited for another request's first use of the key, and met
/// the key once that committed, was a serialization failure (40001)
/// handed to the caller. It is one of acquire's outcomes now: here the
/// other request still holds the key, so `IdempotencyInProgress`.
#[tokio::test]
async fn an_acquire_meeting_a_first_use_under_a_stricter_default_isolation_says_why() {
    let (db, pool) = setup().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{}\" SET default_transaction_isolation = 'serializable'",
        db.name()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let race = Interleaving::new(db.options()).await.unwrap();
    let first = race.session("first").await.unwrap();
    let second = race.session("second").await.unwrap();
    // The first request's use of the key, as acquire writes it, not yet
    // committed.
    let mut tx = pgonce::begin(first.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(
        &first,
        "first use",
        sqlx::query(
            "INSERT INTO pgonce.idempotency_keys (scope, key, fingerprint, hold_token, held_until) \
             VALUES ('api', 'k', $1, gen_random_uuid(), now() + interval '1 hour')",
        )
        .bind(&fp)
        .execute(&mut *tx),
    )
    .await
    .unwrap()
    .unwrap();
    let (pool_2, fp_2) = (second.pool().clone(), fp.clone());
    let waiting = race
        .step_blocks(&second, "acquire", async move {
            dedupe::acquire(&pool_2, "api", "k", &fp_2, Duration::from_secs(60)).await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["first"]);
    race.step(&first, "COMMIT", tx.commit())
        .await
        .unwrap()
        .unwrap();
    let out = waiting.resume().await.unwrap();
    assert!(
        matches!(out, Err(Error::IdempotencyInProgress { .. })),
        "{out:?}"
    );
}

/// The collector's deletes ran alone on its pool, at the database's
/// default level: under REPEATABLE READ, an old processed-message row
/// changed after the statement's snapshot was a serialization failure and
/// the pass failed. At READ COMMITTED it re-reads the row: here refreshed,
/// so it stays.
#[tokio::test]
async fn the_collector_under_a_stricter_default_isolation_keeps_a_row_refreshed_meanwhile() {
    let (db, pool) = setup().await;
    sqlx::query(
        "INSERT INTO pgonce.processed_messages (consumer, message_id, processed_at) \
         VALUES ('c', 'm', now() - interval '30 days')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (race, passer, writer) =
        support::pass_and_writer(db.options(), "collector", "consumer").await;
    let collector = Collector::new(passer.pool().clone(), CollectorConfig::default()).unwrap();
    sqlx::query("UPDATE pgonce.processed_messages SET processed_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(collector.run_once().await.unwrap().processed_messages, 0);
    sqlx::query("UPDATE pgonce.processed_messages SET processed_at = now() - interval '30 days'")
        .execute(&pool)
        .await
        .unwrap();
    let out = support::pass_meeting_a_committed_change(
        &race,
        &passer,
        &writer,
        "pgonce.processed_messages",
        "UPDATE pgonce.processed_messages SET processed_at = now()",
        async move { collector.run_once().await },
    )
    .await;
    assert_eq!(out.unwrap().processed_messages, 0);
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.processed_messages")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(kept, 1);
}

/// A response whose JSON text is past what PostgreSQL takes in one message
/// (1 GiB): `finish` sent it unchecked and the server dropped the
/// connection (`Connection reset by peer`). Refused as bad input now,
/// nothing written: the hold stands, and finishes with a smaller response.
#[tokio::test]
async fn a_response_past_one_message_is_refused_and_the_hold_stands() {
    let (_db, pool) = setup().await;
    let print = dedupe::fingerprint(&json!("request")).unwrap();
    let Acquired::Process(hold) =
        dedupe::acquire(&pool, "api", "k", &print, Duration::from_secs(60))
            .await
            .unwrap()
    else {
        panic!("a new key is processed");
    };
    // Six bytes of text (`\u0001`) a character: past 1 GiB in all.
    let huge = json!("\u{1}".repeat((1 << 30) / 6 + 1_000));
    let finished = dedupe::finish(&pool, &hold, &huge).await;
    drop(huge);
    assert!(
        matches!(&finished, Err(Error::Invalid { what: "idempotency response", why }) if why.contains("1 GiB")),
        "finish: {:?}",
        finished.map_err(|e| e.to_string())
    );
    dedupe::finish(&pool, &hold, &json!("ok")).await.unwrap();
    let replay = dedupe::acquire(&pool, "api", "k", &print, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(replay, Acquired::Replay(json!("ok")));
}

/// A fingerprint past what PostgreSQL takes in one message (1 GiB): the
/// key's upsert sent it and the server dropped the connection. Refused as
/// bad input now, nothing written: the key is new to the next request.
#[tokio::test]
async fn a_fingerprint_past_one_message_is_refused() {
    let (_db, pool) = setup().await;
    let huge = vec![7u8; (1 << 30) + 1_000];
    let acquired = dedupe::acquire(&pool, "api", "k", &huge, Duration::from_secs(60)).await;
    drop(huge);
    assert!(
        matches!(&acquired, Err(Error::Invalid { what: "idempotency fingerprint", why }) if why.contains("1 GiB")),
        "acquire: {:?}",
        acquired.map_err(|e| e.to_string())
    );
    let print = dedupe::fingerprint(&json!("request")).unwrap();
    let again = dedupe::acquire(&pool, "api", "k", &print, Duration::from_secs(60)).await;
    assert!(matches!(again, Ok(Acquired::Process(_))), "{again:?}");
}
