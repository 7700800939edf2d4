//! The DCB event store against a real PostgreSQL: the specification's
//! semantics, a randomized oracle, and catch-up under concurrent writers.
//! The step-by-step races (three writers under each strategy, out-of-order
//! commits) live in the lab, asserted by pgonce-lab's tests/races.rs.

use std::collections::BTreeSet;
use std::time::Duration;

use pgonce::Error;
use pgonce::events::{
    AppendCondition, AppendStrategy, Event, EventStore, EventStoreConfig, Query, QueryItem,
    ReadOptions, StoredEvent, SubscriptionConfig,
};
use pgonce_testkit::{Interleaving, ScratchDatabase, fresh_database};
use rand::Rng;
use serde_json::json;
use sqlx::PgPool;

async fn db() -> (ScratchDatabase, PgPool) {
    let db = fresh_database().await;
    let pool = db.pool(24).await.unwrap();
    pgonce::migrate(&pool).await.unwrap();
    (db, pool)
}

fn store(pool: &PgPool, strategy: AppendStrategy) -> EventStore {
    EventStore::new(
        pool.clone(),
        EventStoreConfig {
            strategy,
            ..Default::default()
        },
    )
    .unwrap()
}

fn booked(tag: &str) -> Event {
    Event::new("BookingPlaced")
        .tag(tag)
        .data(json!({ "booking": tag }))
}

fn positions(events: &[StoredEvent]) -> Vec<i64> {
    events.iter().map(|e| e.position).collect()
}

fn tag_query(tag: &str) -> Query {
    Query::item(Vec::<String>::new(), [tag]).unwrap()
}

// ---------------------------------------------------------------- semantics

/// Spec: an item matches when the type is any of its types and the event
/// carries all of its tags; items are OR-ed; Query::all matches everything;
/// read honours from, limit and direction; head is the last position.
#[tokio::test]
async fn queries_match_as_the_specification_says() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    assert_eq!(s.head().await.unwrap(), None);
    let events = [
        Event::new("A").tag("t1").tag("t2"),
        Event::new("B").tag("t1"),
        Event::new("C").tag("t2").tag("t3"),
        Event::new("A"),
    ];
    let appended = s.append(&events, None).await.unwrap();
    assert_eq!(appended.positions, vec![1, 2, 3, 4], "in the order given");
    assert_eq!(s.head().await.unwrap(), Some(4));

    let read = |q: Query| {
        let s = s.clone();
        async move { positions(&s.read(&q, ReadOptions::default()).await.unwrap()) }
    };
    assert_eq!(read(Query::all()).await, vec![1, 2, 3, 4]);
    assert_eq!(
        read(Query::item(["A"], Vec::<&str>::new()).unwrap()).await,
        vec![1, 4]
    );
    assert_eq!(
        read(Query::item(["A", "B"], Vec::<&str>::new()).unwrap()).await,
        vec![1, 2, 4],
        "types: any of"
    );
    assert_eq!(
        read(Query::item(Vec::<&str>::new(), ["t1", "t2"]).unwrap()).await,
        vec![1],
        "tags: all of"
    );
    assert_eq!(
        read(Query::item(["B", "C"], ["t2"]).unwrap()).await,
        vec![3],
        "type and tags"
    );
    let or = Query::items([QueryItem::new().types(["B"]), QueryItem::new().tags(["t3"])]).unwrap();
    assert_eq!(read(or.clone()).await, vec![2, 3], "items: OR");
    // The Rust-side matcher agrees with the SQL (the oracle below uses it).
    let all = s.read(&Query::all(), ReadOptions::default()).await.unwrap();
    let by_rust: Vec<i64> = all
        .iter()
        .filter(|e| or.matches(&e.event))
        .map(|e| e.position)
        .collect();
    assert_eq!(by_rust, vec![2, 3]);

    let opts = |from, limit, backwards| ReadOptions {
        from,
        limit,
        backwards,
    };
    assert_eq!(
        positions(
            &s.read(&Query::all(), opts(Some(2), Some(2), false))
                .await
                .unwrap()
        ),
        vec![2, 3]
    );
    assert_eq!(
        positions(
            &s.read(&Query::all(), opts(None, Some(2), true))
                .await
                .unwrap()
        ),
        vec![4, 3]
    );
    assert_eq!(
        positions(
            &s.read(&Query::all(), opts(Some(2), None, true))
                .await
                .unwrap()
        ),
        vec![2, 1]
    );
    let stored = &s
        .read(&Query::all(), opts(Some(1), Some(1), false))
        .await
        .unwrap()[0];
    assert_eq!(
        stored.event, events[0],
        "type, tags, data and metadata round-trip"
    );
}

/// Spec: the append fails if an event matching the condition exists after
/// `after` (anywhere without one), with a typed error naming the matches,
/// and writes nothing; it succeeds when the matches are all at or below.
#[tokio::test]
async fn a_condition_fails_only_on_matches_after_its_position() {
    let (_db, pool) = db().await;
    for strategy in AppendStrategy::ALL {
        sqlx::query("TRUNCATE pgonce.events RESTART IDENTITY")
            .execute(&pool)
            .await
            .unwrap();
        let s = store(&pool, strategy);
        s.append(&[booked("booking:1")], None).await.unwrap();
        s.append(&[Event::new("Other").tag("x")], None)
            .await
            .unwrap();
        let q = tag_query("booking:1");

        let err = s
            .append(
                &[booked("booking:1")],
                Some(&AppendCondition::new(q.clone(), None)),
            )
            .await
            .unwrap_err();
        match err {
            Error::AppendConditionFailed { after, matching } => {
                assert_eq!((after, matching), (None, vec![1]), "{strategy:?}");
            }
            other => panic!("{strategy:?}: expected a failed condition, got {other}"),
        }
        let err = s
            .append(
                &[booked("booking:1")],
                Some(&AppendCondition::new(q.clone(), Some(0))),
            )
            .await
            .unwrap_err();
        assert!(matches!(
            err,
            Error::AppendConditionFailed { after: Some(0), .. }
        ));
        assert_eq!(
            s.head().await.unwrap(),
            Some(2),
            "{strategy:?}: nothing written"
        );

        let ok = s
            .append(
                &[booked("booking:1")],
                Some(&AppendCondition::new(q.clone(), Some(1))),
            )
            .await
            .unwrap();
        assert_eq!(
            ok.positions,
            vec![3],
            "{strategy:?}: matches at or below `after` are fine"
        );
        // Type-only and match-all conditions.
        let type_only = Query::item(["Other"], Vec::<&str>::new()).unwrap();
        assert!(
            s.append(
                &[Event::new("Other")],
                Some(&AppendCondition::new(type_only.clone(), Some(2)))
            )
            .await
            .is_ok()
        );
        assert!(matches!(
            s.append(
                &[Event::new("Other")],
                Some(&AppendCondition::new(type_only, Some(1)))
            )
            .await,
            Err(Error::AppendConditionFailed { .. })
        ));
        let head = s.head().await.unwrap();
        assert!(
            s.append(
                &[Event::new("Z")],
                Some(&AppendCondition::new(Query::all(), head))
            )
            .await
            .is_ok()
        );
        assert!(matches!(
            s.append(
                &[Event::new("Z")],
                Some(&AppendCondition::new(Query::all(), head))
            )
            .await,
            Err(Error::AppendConditionFailed { .. })
        ));
    }
}

/// Bad input is a typed error and nothing is half-written: an append whose
/// second event is invalid stores neither.
#[tokio::test]
async fn bad_input_is_rejected_whole() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    for events in [
        vec![booked("ok"), Event::new("")],
        vec![booked("ok"), Event::new("T").tag("")],
        vec![],
    ] {
        assert!(matches!(
            s.append(&events, None).await,
            Err(Error::Invalid { .. })
        ));
    }
    assert!(matches!(Query::items([]), Err(Error::Invalid { .. })));
    assert!(matches!(
        Query::items([QueryItem::new()]),
        Err(Error::Invalid { .. })
    ));
    let bad = AppendCondition::new(Query::Items(vec![]), None);
    assert!(matches!(
        s.append(&[booked("ok")], Some(&bad)).await,
        Err(Error::Invalid { .. })
    ));
    assert_eq!(s.head().await.unwrap(), None);
}

// The event-store seed's three writers and the out-of-order commits (a
// decision and a catch-up reader facing a lower position still in flight)
// are replayed once, in the lab: `pgonce race events`, asserted by
// pgonce-lab's tests/races.rs.

// ------------------------------------------------------------ randomized

/// Randomized concurrent appends, each conditioned on a decision read of its
/// tag; afterwards an oracle replays the log and proves that no accepted
/// append violated its condition: every other event matching its query
/// above its `after` sits above it and was decided after it (its own
/// `after` is at least the accepted event's position).
#[tokio::test]
async fn randomized_appends_never_violate_a_condition() {
    let (_db, pool) = db().await;
    for strategy in AppendStrategy::ALL {
        sqlx::query("TRUNCATE pgonce.events RESTART IDENTITY")
            .execute(&pool)
            .await
            .unwrap();
        let s = store(&pool, strategy);
        let mut tasks = Vec::new();
        for worker in 0..8 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                let (mut ok, mut failed) = (0, 0);
                for _ in 0..25 {
                    let (tag, extra, type_only) = {
                        let mut rng = rand::rng();
                        (rng.random_range(0..4), rng.random_range(0..6), rng.random_bool(0.1))
                    };
                    let tag = format!("t{tag}");
                    let query = if type_only {
                        Query::item(["Typed"], Vec::<&str>::new()).unwrap()
                    } else {
                        tag_query(&tag)
                    };
                    let decision = s.decide(&query).await.unwrap();
                    // Each event belongs to one class (its tag, or the
                    // untagged "Typed" type) that only its own class's query
                    // matches, plus a noise tag no query uses: more keys to
                    // take in order, and a symmetric oracle.
                    let mut e = if type_only {
                        Event::new("Typed")
                    } else {
                        Event::new("Booked").tag(&tag)
                    }
                    .metadata(json!({ "after": decision.after, "worker": worker, "type_only": type_only }));
                    if extra < 4 {
                        e = e.tag(format!("noise{extra}"));
                    }
                    match s.append(&[e], Some(&AppendCondition::new(query, decision.after))).await {
                        Ok(_) => ok += 1,
                        Err(Error::AppendConditionFailed { .. }) => failed += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                (ok, failed)
            }));
        }
        let (mut ok, mut failed) = (0, 0);
        for t in tasks {
            let (o, f) = t.await.unwrap();
            ok += o;
            failed += f;
        }
        let log = s.read(&Query::all(), ReadOptions::default()).await.unwrap();
        assert_eq!(
            log.len(),
            ok,
            "{strategy:?}: every accepted append is in the log"
        );
        // Within a class, an accepted `e` and any other `f` above `e.after`
        // must be ordered: `f` above `e` and decided after `e` committed. A
        // pair both decided before the other committed (write skew) or an
        // `f` that committed before `e`'s check is a violation.
        let mut violations = Vec::new();
        for e in &log {
            let after = e.event.metadata["after"].as_i64().unwrap_or(0);
            let query = if e.event.metadata["type_only"] == json!(true) {
                Query::item(["Typed"], Vec::<&str>::new()).unwrap()
            } else {
                tag_query(e.event.tags.iter().find(|t| t.starts_with('t')).unwrap())
            };
            for f in &log {
                if f.position == e.position || f.position <= after || !query.matches(&f.event) {
                    continue;
                }
                let f_after = f.event.metadata["after"].as_i64().unwrap_or(0);
                if f.position < e.position || f_after < e.position {
                    violations.push((e.position, f.position));
                }
            }
        }
        assert!(
            violations.is_empty(),
            "{strategy:?}: accepted appends violated their conditions: {violations:?}"
        );
        assert!(
            ok > 0 && failed > 0,
            "{strategy:?}: the run had both outcomes ({ok} ok, {failed} failed)"
        );
    }
}

/// Catch-up under concurrent writers that commit out of order (and roll
/// some back): the subscription delivers every committed event exactly
/// once, in increasing position order.
#[tokio::test]
async fn catch_up_under_concurrent_writers_delivers_every_event_in_order() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let mut sub = s
        .subscribe(SubscriptionConfig {
            batch: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut writers = Vec::new();
    for w in 0..6 {
        let s = s.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..40 {
                let (hold, rollback) = {
                    let mut rng = rand::rng();
                    (rng.random_range(0..3u64), rng.random_bool(0.1))
                };
                let p = s
                    .begin_append(&[booked(&format!("w{w}")).data(json!(i))], None)
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(hold)).await;
                if rollback {
                    p.rollback().await.unwrap();
                } else {
                    p.commit().await.unwrap();
                }
            }
        }));
    }
    let mut seen = Vec::new();
    let mut done = false;
    while !done {
        done = writers.iter().all(|w| w.is_finished());
        // Catch up as far as possible (after the writers finished: fully).
        loop {
            let (events, counters) = sub.run_once().await.unwrap();
            seen.extend(positions(&events));
            if counters.advanced == 0 && !counters.waiting_on_gap {
                break;
            }
            if counters.advanced == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        if !done {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let committed: Vec<i64> =
        sqlx::query_scalar("SELECT position FROM pgonce.events ORDER BY position")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "delivered in increasing order"
    );
    assert_eq!(seen, committed, "every committed event, once");
    assert!(committed.len() > 150);
    let unique: BTreeSet<i64> = seen.iter().copied().collect();
    assert_eq!(unique.len(), seen.len());
}

/// The subscription wakes on NOTIFY: `next` returns soon after an append
/// even with a long poll interval.
#[tokio::test]
async fn next_is_woken_by_notify() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let mut sub = s
        .subscribe(SubscriptionConfig {
            poll_interval: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .unwrap();
    let waiter = tokio::spawn(async move { sub.next().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.append(&[booked("x")], None).await.unwrap();
    let events = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("woken long before the 30 s poll")
        .unwrap()
        .unwrap();
    assert_eq!(positions(&events), vec![1]);
}

// ------------------------------------------------------------------ indexes

/// Not a check: generates a log of 1,000,000 events with `INSERT ... SELECT
/// generate_series` and prints EXPLAIN (ANALYZE, BUFFERS) of the condition
/// and read queries, for docs/events-indexes.md. Run with
/// `cargo test -p pgonce --test events -- --ignored --nocapture explain`.
#[tokio::test]
#[ignore = "generates 1,000,000 events; run by hand for docs/events-indexes.md"]
async fn explain_condition_queries_on_a_million_events() {
    let (_db, pool) = db().await;
    let started = std::time::Instant::now();
    sqlx::raw_sql(
        "INSERT INTO pgonce.events (type, tags, data)
         SELECT (ARRAY['BookingPlaced','BookingCancelled','CustomerRegistered','PaymentTaken',
                       'RoomAdded','PriceChanged','InvoiceSent','ReviewPosted','CheckIn','CheckOut'])[1 + i % 10],
                ARRAY['booking:' || (i % 200000), 'customer:' || (i % 20000)],
                jsonb_build_object('i', i)
         FROM generate_series(1, 1000000) AS i;
         ANALYZE pgonce.events;",
    )
    .execute(&pool)
    .await
    .unwrap();
    println!("generated 1,000,000 events in {:?}", started.elapsed());
    let cases = [
        (
            "tag item (booking:4242), after 900000",
            "SELECT position FROM pgonce.events e WHERE (e.tags @> $2::text[]) AND e.position > $1 ORDER BY e.position LIMIT 16",
            vec![vec!["booking:4242".to_string()]],
            900_000i64,
        ),
        (
            "tag item, two tags (booking:4242 + customer:4242)",
            "SELECT position FROM pgonce.events e WHERE (e.tags @> $2::text[]) AND e.position > $1 ORDER BY e.position LIMIT 16",
            vec![vec![
                "booking:4242".to_string(),
                "customer:4242".to_string(),
            ]],
            0,
        ),
        (
            "type + tag item (BookingCancelled, customer:77)",
            "SELECT position FROM pgonce.events e WHERE (e.tags @> $2::text[] AND e.type = ANY($3::text[])) AND e.position > $1 ORDER BY e.position LIMIT 16",
            vec![
                vec!["customer:77".to_string()],
                vec!["BookingCancelled".to_string()],
            ],
            0,
        ),
        (
            "type-only item (ReviewPosted), after 999000",
            "SELECT position FROM pgonce.events e WHERE (e.type = ANY($2::text[])) AND e.position > $1 ORDER BY e.position LIMIT 16",
            vec![vec!["ReviewPosted".to_string()]],
            999_000,
        ),
        (
            "two items OR-ed (booking:4242 | customer:77)",
            "SELECT position FROM pgonce.events e WHERE ((e.tags @> $2::text[]) OR (e.tags @> $3::text[])) AND e.position > $1 ORDER BY e.position LIMIT 16",
            vec![
                vec!["booking:4242".to_string()],
                vec!["customer:77".to_string()],
            ],
            0,
        ),
    ];
    for (name, sql, binds, after) in cases {
        let mut q = sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, SUMMARY ON) {sql}"
        )))
        .bind(after);
        for b in binds {
            q = q.bind(b);
        }
        let plan = q.fetch_all(&pool).await.unwrap();
        println!("\n### {name}\n\n```text\n{sql}\n\n{}\n```", plan.join("\n"));
    }
}

/// `append_in` writes inside the caller's transaction: its events commit and
/// roll back with the caller's other writes, and the serializable strategy
/// refuses a transaction its conflict detection cannot see.
#[tokio::test]
async fn an_append_in_the_callers_transaction_commits_and_rolls_back_with_it() {
    let (_db, pool) = db().await;
    let events = store(&pool, AppendStrategy::AdvisoryLocks);

    let mut tx = pool.begin().await.unwrap();
    events.append_in(&mut tx, &[booked("a")]).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        events.head().await.unwrap(),
        None,
        "rolled back with the caller"
    );

    let mut tx = pool.begin().await.unwrap();
    let at = events.append_in(&mut tx, &[booked("b")]).await.unwrap();
    tx.commit().await.unwrap();
    let read = events
        .read(&tag_query("b"), ReadOptions::default())
        .await
        .unwrap();
    assert_eq!(positions(&read), at);

    let mut tx = pool.begin().await.unwrap();
    let refused = store(&pool, AppendStrategy::Serializable)
        .append_in(&mut tx, &[booked("c")])
        .await;
    assert!(
        matches!(refused, Err(Error::WrongIsolation { .. })),
        "{refused:?}"
    );
    let empty = events.append_in(&mut tx, &[]).await;
    assert!(matches!(empty, Err(Error::Invalid { .. })), "{empty:?}");
}

/// An append opens its transaction and takes its locks in one message; a
/// lock that fails there (here: `lock_timeout` while another transaction
/// holds the tag's key exclusive) returns the error and leaves the pooled
/// connection idle, not inside an aborted transaction: the next append on
/// that same (only) connection succeeds and writes exactly one event.
#[tokio::test]
async fn a_failed_lock_leaves_the_connection_usable() {
    let (db, pool) = db().await;
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options().options([("lock_timeout", "200ms")]))
        .await
        .unwrap();
    let key = pgonce::LockKey::new(pgonce::events::TAG_NAMESPACE, "busy").unwrap();
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(key.as_i64())
        .execute(&mut *blocker)
        .await
        .unwrap();
    let events = store(&one, AppendStrategy::AdvisoryLocks);
    let failed = events.append(&[booked("busy")], None).await;
    assert!(failed.is_err(), "{failed:?}");
    blocker.rollback().await.unwrap();

    let appended = events.append(&[booked("busy")], None).await.unwrap();
    let read = events
        .read(&tag_query("busy"), ReadOptions::default())
        .await
        .unwrap();
    assert_eq!(positions(&read), appended.positions);
}

/// An append given up while it waits for its locks (its caller's client
/// went away) leaves nothing behind: once the holder commits, the waiting
/// statement finishes on the server, and its connection goes back to the
/// pool outside any transaction, holding no lock. Before, sqlx did not yet
/// count the transaction as open and the connection came back inside it.
#[tokio::test]
async fn an_append_dropped_while_it_waits_leaves_no_transaction_open() {
    let (db, _pool) = db().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let st = |s: &pgonce_testkit::Session| store(s.pool(), AppendStrategy::AdvisoryLocks);
    let condition = AppendCondition::new(tag_query("booking:1"), None);
    let held = race
        .step(
            &a,
            "begin_append",
            st(&a).begin_append(&[booked("booking:1")], Some(&condition)),
        )
        .await
        .unwrap()
        .unwrap();
    let (sb, cb) = (st(&b), condition.clone());
    let waiting = race
        .step_blocks(&b, "append", async move {
            sb.append(&[booked("booking:1")], Some(&cb)).await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    waiting.cancel();
    held.commit().await.unwrap();

    // B's one connection, once it is back in its pool.
    let mut conn = b.pool().acquire().await.unwrap();
    let (in_transaction, advisory_locks): (bool, i64) = sqlx::query_as(
        "SELECT pg_current_xact_id_if_assigned() IS NOT NULL, \
                (SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory')",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert!(
        !in_transaction,
        "the connection came back inside B's transaction"
    );
    assert_eq!(advisory_locks, 0);
    // And the key is free: another append on the tag commits at once.
    drop(conn);
    st(&b).append(&[booked("booking:1")], None).await.unwrap();
}
