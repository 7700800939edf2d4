//! The DCB event store against a real PostgreSQL: the specification's
//! semantics, a randomized oracle, and catch-up under concurrent writers.
//! The step-by-step races (three writers under each strategy, out-of-order
//! commits) live in the lab, asserted by pgonce-lab's tests/races.rs.

mod support;

use std::time::Duration;

use pgonce::Error;
use pgonce::IsolationLevel;
use pgonce::events::{
    AppendCondition, AppendStrategy, Appended, Event, EventStore, EventStoreConfig, PollHook,
    PollOutcome, PollPoint, Query, QueryItem, ReadOptions, StoredEvent, Subscription,
    SubscriptionConfig,
};
use pgonce_testkit::{
    FAILSAFE, FaultProxy, Interleaving, NewConnections, ScratchDatabase, fresh_migrated_database,
};
use rand::Rng;
use serde_json::json;
use sqlx::PgPool;
use support::mixed::{
    MixedKind, MixedTx, Refused, course, mixed_round, mixed_violations, tag_query,
};

async fn db() -> (ScratchDatabase, PgPool) {
    let (db, pool) = fresh_migrated_database(24, pgonce::migrate).await;
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

/// Empties the log and restarts its positions at 1.
async fn empty_log(pool: &PgPool) {
    sqlx::query("TRUNCATE pgonce.events RESTART IDENTITY")
        .execute(pool)
        .await
        .unwrap();
}

fn booked(tag: &str) -> Event {
    Event::new("BookingPlaced")
        .tag(tag)
        .data(json!({ "booking": tag }))
}

fn positions(events: &[StoredEvent]) -> Vec<i64> {
    events.iter().map(|e| e.position).collect()
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
        empty_log(&pool).await;
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

/// A condition on one item naming a tag (the one-statement path with kept
/// plans, migration 0170) finds its matches however far its `after` is
/// below the head: near it (up to 512 positions) through an ordered walk of
/// the primary key, further through a check planned for its values; with
/// types (migration 0110's path), only events of those types match. The
/// decision read on such a query returns exactly the matching events.
#[tokio::test]
async fn a_tag_item_condition_is_checked_near_and_far_from_the_head() {
    let (_db, pool) = db().await;
    for strategy in AppendStrategy::ALL {
        empty_log(&pool).await;
        let s = store(&pool, strategy);
        s.append(&[booked("booking:7")], None).await.unwrap();
        let filler: Vec<Event> = (0..600)
            .map(|i| Event::new("Filler").tag(format!("filler:{i}")))
            .collect();
        s.append(&filler, None).await.unwrap();
        assert_eq!(s.head().await.unwrap(), Some(601));
        let tag = tag_query("booking:7");
        let typed = |types: &[&str]| {
            Query::items([QueryItem::new()
                .types(types.iter().copied())
                .tags(["booking:7"])])
            .unwrap()
        };
        let cancelled = || Event::new("Cancelled").tag("booking:7");
        let refused = |r: pgonce::Result<pgonce::events::Appended>| match r {
            Err(Error::AppendConditionFailed { matching, .. }) => matching,
            other => panic!("{strategy:?}: expected a failed condition, got {other:?}"),
        };

        // 601 positions below the head: the GIN.
        let matching = refused(
            s.append(
                &[cancelled()],
                Some(&AppendCondition::new(tag.clone(), Some(0))),
            )
            .await,
        );
        assert_eq!(matching, vec![1], "{strategy:?}");
        let matching = refused(
            s.append(
                &[cancelled()],
                Some(&AppendCondition::new(tag.clone(), Some(i64::MIN))),
            )
            .await,
        );
        assert_eq!(
            matching,
            vec![1],
            "{strategy:?}: the lowest `after` there is"
        );
        let ok = s
            .append(
                &[cancelled()],
                Some(&AppendCondition::new(tag.clone(), Some(1))),
            )
            .await
            .unwrap();
        assert_eq!(ok.positions, vec![602], "{strategy:?}: 1 is not above 1");
        let matching = refused(
            s.append(
                &[cancelled()],
                Some(&AppendCondition::new(typed(&["Cancelled"]), Some(0))),
            )
            .await,
        );
        assert_eq!(matching, vec![602], "{strategy:?}");
        let ok = s
            .append(
                &[booked("booking:7")],
                Some(&AppendCondition::new(typed(&["BookingPlaced"]), Some(1))),
            )
            .await
            .unwrap();
        assert_eq!(ok.positions, vec![603], "{strategy:?}: 602 is Cancelled");

        // A few positions below the head: the walk.
        let matching = refused(
            s.append(
                &[cancelled()],
                Some(&AppendCondition::new(tag.clone(), Some(601))),
            )
            .await,
        );
        assert_eq!(matching, vec![602, 603], "{strategy:?}");
        let matching = refused(
            s.append(
                &[cancelled()],
                Some(&AppendCondition::new(typed(&["BookingPlaced"]), Some(600))),
            )
            .await,
        );
        assert_eq!(matching, vec![603], "{strategy:?}");
        let ok = s
            .append(
                &[cancelled()],
                Some(&AppendCondition::new(typed(&["BookingPlaced"]), Some(603))),
            )
            .await
            .unwrap();
        assert_eq!(
            ok.positions,
            vec![604],
            "{strategy:?}: 603 is not above 603"
        );
        let ok = s
            .append(
                &[cancelled()],
                Some(&AppendCondition::new(typed(&["Other"]), Some(600))),
            )
            .await
            .unwrap();
        assert_eq!(ok.positions, vec![605], "{strategy:?}");

        let decision = s.decide(&tag).await.unwrap();
        assert_eq!(positions(&decision.events), vec![1, 602, 603, 604, 605]);
        assert_eq!(decision.after, Some(605));
        let decision = s.decide(&typed(&["Cancelled", "Other"])).await.unwrap();
        assert_eq!(
            positions(&decision.events),
            vec![602, 604, 605],
            "{strategy:?}"
        );
        assert_eq!(decision.after, Some(605));
    }
}

/// The one-item tag path (migrations 0170 and 0180) answers every query as
/// the model does and as the general path does (the same item twice, which
/// takes migration 0110's query built as text): random items of one or two
/// tags and zero to two types over a log of 800 events, decision reads and
/// conditions with `after` anywhere from `i64::MIN` to past the head, so
/// both branches of the check run; appends of one event (its fields as
/// parameters) and of two (a JSON array), under either lock strategy. A
/// failure names its seed and round.
#[tokio::test]
async fn tag_item_queries_answer_as_the_model_and_the_general_path_do() {
    use rand::SeedableRng;
    let (_db, pool) = db().await;
    empty_log(&pool).await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let table_lock = store(&pool, AppendStrategy::TableLock);
    let seed = rand::random::<u64>();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let tags = ["t0", "t1", "t2", "t3", "t4", "t5"];
    let types = ["A", "B", "C"];
    for _ in 0..8 {
        let batch: Vec<Event> = (0..100)
            .map(|_| {
                let mut e = Event::new(types[rng.random_range(0..types.len())]);
                for t in tags {
                    if rng.random_bool(0.3) {
                        e = e.tag(t);
                    }
                }
                e
            })
            .collect();
        s.append(&batch, None).await.unwrap();
    }
    let mut log = s.read(&Query::all(), ReadOptions::default()).await.unwrap();
    for round in 0..150 {
        let pick = |rng: &mut rand::rngs::StdRng, from: &[&'static str], n: usize| {
            let mut chosen: Vec<&str> = Vec::new();
            while chosen.len() < n {
                let x = from[rng.random_range(0..from.len())];
                if !chosen.contains(&x) {
                    chosen.push(x);
                }
            }
            chosen
        };
        let n_tags = rng.random_range(1..=2);
        let n_types = rng.random_range(0..=2);
        let item = QueryItem::new()
            .tags(pick(&mut rng, &tags, n_tags))
            .types(pick(&mut rng, &types, n_types));
        let fast = Query::items([item.clone()]).unwrap();
        let general = Query::items([item.clone(), item.clone()]).unwrap();
        let context = format!("seed {seed}, round {round}, {item:?}");
        let head = log.last().map(|e| e.position);
        let model: Vec<i64> = log
            .iter()
            .filter(|e| item.matches(&e.event))
            .map(|e| e.position)
            .collect();

        for query in [&fast, &general] {
            let decision = s.decide(query).await.unwrap();
            assert_eq!(positions(&decision.events), model, "{context}");
            assert_eq!(decision.after, head, "{context}");
        }

        let head = head.unwrap_or(0);
        let after = match rng.random_range(0..10) {
            0 => i64::MIN,
            1 => head + 5,
            2..=5 => head - rng.random_range(0..40),
            _ => rng.random_range(0..=head),
        };
        let expected: Vec<i64> = model
            .iter()
            .copied()
            .filter(|&p| p > after)
            .take(16)
            .collect();
        let probes: Vec<Event> = (0..rng.random_range(1..=2))
            .map(|_| Event::new("Probe").tag("probe"))
            .collect();
        let appender = if rng.random_bool(0.5) {
            &s
        } else {
            &table_lock
        };
        let context = format!("{context}, {} probes", probes.len());
        for query in [&fast, &general] {
            let outcome = appender
                .append(
                    &probes,
                    Some(&AppendCondition::new(query.clone(), Some(after))),
                )
                .await;
            match outcome {
                Ok(appended) => {
                    assert!(
                        expected.is_empty(),
                        "{context}, after {after}: accepted over {expected:?}"
                    );
                    assert_eq!(appended.positions.len(), probes.len(), "{context}");
                    let probe = s
                        .read(
                            &Query::all(),
                            ReadOptions {
                                from: appended.positions.first().copied(),
                                ..Default::default()
                            },
                        )
                        .await
                        .unwrap();
                    log.extend(probe);
                }
                Err(Error::AppendConditionFailed { matching, .. }) => {
                    assert_eq!(matching, expected, "{context}, after {after}");
                }
                Err(e) => panic!("{context}, after {after}: {e}"),
            }
        }
    }
}

/// Bad input is a typed error and nothing is half-written: an append whose
/// second event is invalid stores neither. Refused before the database is
/// asked: a NUL character, which neither PostgreSQL's text nor its jsonb
/// can hold, wherever it is (type, tag, a string or a key of the data or
/// metadata, a query's tag or type); a type or tag longer than an index
/// entry may be; JSON nested deeper than can be read back (stored, it
/// would stop every read that reached it).
#[tokio::test]
async fn bad_input_is_rejected_whole() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let mut too_deep = json!(1);
    for _ in 0..=pgonce::events::MAX_JSON_NESTING {
        too_deep = json!([too_deep]);
    }
    for events in [
        vec![booked("ok"), Event::new("")],
        vec![booked("ok"), Event::new("T").tag("")],
        vec![],
        vec![booked("ok"), Event::new("T\0")],
        vec![booked("ok"), Event::new("T").tag("a\0b")],
        vec![booked("ok"), Event::new("T").data(json!({ "s": ["x\0"] }))],
        vec![booked("ok"), Event::new("T").data(json!({ "k\0": 1 }))],
        vec![
            booked("ok"),
            Event::new("T").metadata(json!({ "who": "\0" })),
        ],
        vec![Event::new("T").tag("a\0b")],
        vec![
            booked("ok"),
            Event::new("T").tag("t".repeat(pgonce::events::MAX_NAME_BYTES + 1)),
        ],
        vec![
            booked("ok"),
            Event::new("é".repeat(pgonce::events::MAX_NAME_BYTES / 2 + 1)),
        ],
        vec![booked("ok"), Event::new("T").data(too_deep.clone())],
        vec![
            booked("ok"),
            Event::new("T").metadata(json!({ "k": too_deep.clone() })),
        ],
    ] {
        let outcome = s.append(&events, None).await;
        assert!(
            matches!(outcome, Err(Error::Invalid { .. })),
            "{events:?}: {outcome:?}"
        );
        let condition = AppendCondition::new(tag_query("ok"), None);
        let outcome = s.append(&events, Some(&condition)).await;
        assert!(
            matches!(outcome, Err(Error::Invalid { .. })),
            "{events:?}, conditional: {outcome:?}"
        );
    }
    for item in [
        QueryItem::new().tags(["a\0"]),
        QueryItem::new().types(["T\0"]),
    ] {
        let outcome = Query::items([item.clone()]);
        assert!(
            matches!(outcome, Err(Error::Invalid { .. })),
            "{item:?}: {outcome:?}"
        );
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

/// An append too large for PostgreSQL's jsonb is refused as bad input
/// ([`Error::Invalid`] naming the limit), on each path, nothing written: a
/// string longer than a jsonb string holds (268,435,455 bytes), or events
/// that fit one at a time but not together (the batch travels as one jsonb
/// array, whose elements may total as much). Both came back as a bare
/// database error (SQLSTATE 54000). One path of each kind (one
/// statement, a transaction): sizes like these cost seconds each, and the
/// limits are PostgreSQL's, so the database judges them. And JSON text
/// longer than PostgreSQL takes in one message (1 GiB), though jsonb would
/// hold its values (a control character is one byte in jsonb and six,
/// `\u0001`, in JSON text): the server dropped the connection
/// (`Connection reset by peer`). One event on the one-statement path that
/// binds its data and metadata, and a batch, sent as one array.
#[tokio::test]
async fn an_append_larger_than_jsonb_holds_is_refused_as_bad_input() {
    let (_db, pool) = db().await;
    let half = "x".repeat(140 << 20);
    let too_long = "x".repeat(270 << 20);
    let controls = "\u{1}".repeat(180 << 20);
    let half_controls = "\u{1}".repeat(90 << 20);
    let big = |text: &str| Event::new("T").tag("big").data(json!({ "text": text }));
    let on_big = AppendCondition::new(tag_query("big"), None);
    for (strategy, events, condition, path, limit) in [
        (
            AppendStrategy::AdvisoryLocks,
            vec![big(&half), big(&half)],
            None,
            "two events in one statement",
            "268435455",
        ),
        (
            AppendStrategy::Serializable,
            vec![big(&too_long)],
            Some(&on_big),
            "one event in a transaction",
            "268435455",
        ),
        (
            AppendStrategy::AdvisoryLocks,
            vec![big(&controls)],
            Some(&on_big),
            "one event's text in one statement",
            "1 GiB",
        ),
        (
            AppendStrategy::AdvisoryLocks,
            vec![big(&half_controls), big(&half_controls)],
            None,
            "two events' text in one array",
            "1 GiB",
        ),
    ] {
        let outcome = store(&pool, strategy).append(&events, condition).await;
        assert_refused_as_too_large(path, outcome, limit);
    }
    assert_eq!(
        store(&pool, AppendStrategy::AdvisoryLocks)
            .head()
            .await
            .unwrap(),
        None
    );
}

/// An append whose events' JSON text is within what one statement may
/// send, but whose tags or condition, sent beside it, take it past
/// PostgreSQL's 1 GiB message: the server dropped the connection
/// (`Connection reset by peer`), as for a batch of job results counted
/// without their leases. Refused as bad input now, nothing written. One
/// event on the path that binds its fields, its tags (one, a thousand
/// times over: one lock key) beside its data; and a batch beside a
/// condition naming a 2 MiB tag. Each builds 1 GiB of text: two cases.
#[tokio::test]
async fn an_append_counts_the_tags_and_condition_it_sends_beside_its_events() {
    let (_db, pool) = db().await;
    let max = pgonce::json::MAX_SENT_JSON_BYTES;
    // Six bytes of text (`\u0001`) a character; a few hundred bytes of
    // each event's text are its other fields.
    let one = "\u{1}".repeat((max - 1_000) / 6);
    let two = "\u{1}".repeat((max - 1_000) / 12);
    let long_tag = "t".repeat(pgonce::events::MAX_NAME_BYTES);
    let tagged = (0..1_000).fold(Event::new("T").data(json!({ "text": one })), |event, _| {
        event.tag(long_tag.clone())
    });
    drop(one);
    let on_tag = AppendCondition::new(tag_query("big"), None);
    let on_long_tag = AppendCondition::new(tag_query(&"c".repeat(2 << 20)), None);
    let big = || Event::new("T").tag("big").data(json!({ "text": two }));
    for (events, condition, path) in [
        (vec![tagged], &on_tag, "one event beside its tags"),
        (
            vec![big(), big()],
            &on_long_tag,
            "two events beside the condition",
        ),
    ] {
        let outcome = store(&pool, AppendStrategy::AdvisoryLocks)
            .append(&events, Some(condition))
            .await;
        assert_refused_as_too_large(path, outcome, "1 GiB");
    }
    let head = store(&pool, AppendStrategy::AdvisoryLocks).head().await;
    assert_eq!(head.unwrap(), None, "nothing written");
}

/// A query whose tags alone pass what PostgreSQL takes in one message
/// (1 GiB): a read sent them and the server dropped the connection
/// (`Connection reset by peer`). Refused as bad input now, as a query is
/// built and as a read checks one built by hand. So is one whose tags fit
/// as text arrays but not as the JSON text a condition sends them in
/// (200 MiB of control characters, six bytes each in JSON), counted
/// without writing that text.
#[tokio::test]
async fn a_query_past_one_message_is_refused() {
    let (_db, pool) = db().await;
    let huge = "t".repeat((1 << 30) + 1_000);
    let built = Query::item(Vec::<String>::new(), [huge.as_str()]).map(drop);
    let by_hand = Query::Items(vec![QueryItem::new().tags([huge])]);
    let read = store(&pool, AppendStrategy::AdvisoryLocks)
        .read(&by_hand, ReadOptions::default())
        .await
        .map(drop);
    drop(by_hand);
    let controls = "\u{1}".repeat(200 << 20);
    let as_json = Query::item(Vec::<String>::new(), [controls.as_str()]).map(drop);
    drop(controls);
    for (path, outcome) in [("read", read), ("built", built), ("as JSON", as_json)] {
        assert!(
            matches!(&outcome, Err(Error::Invalid { what: "query", why }) if why.contains("1 GiB")),
            "{path}: {:?}",
            outcome.map_err(|e| e.to_string())
        );
    }
}

/// An append refused as bad input for its size, the error naming `limit`.
fn assert_refused_as_too_large(path: &str, outcome: Result<Appended, Error>, limit: &str) {
    assert!(
        matches!(&outcome, Err(Error::Invalid { what: "event", why }) if why.contains(limit)),
        "{path}: {:?}",
        outcome.map_err(|e| e.to_string())
    );
}

/// A batch that fits PostgreSQL's protocol with its numbers as serde_json
/// writes them is appended, and reads back equal: four events of 900,000
/// doubles of 1e300 each. Written with all 301 of their digits, as every
/// whole double once was (to keep a zero fraction), the batch's text came
/// to 1.09 GB, past the 1 GB PostgreSQL takes in one message, and the
/// server dropped the connection (`Connection reset by peer`) where the
/// append had succeeded before. A whole double this large reads back as a
/// double from its plain digits anyway, so it is written as serde_json
/// writes it (`1e+300`).
#[tokio::test]
async fn a_batch_of_large_whole_doubles_that_fits_is_appended_and_read_back() {
    let (_db, pool) = db().await;
    let numbers = serde_json::Value::Array(vec![json!(1e300); 900_000]);
    let events: Vec<Event> = (0..4)
        .map(|_| Event::new("T").tag("big").data(numbers.clone()))
        .collect();
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let appended = s.append(&events, None).await;
    assert!(
        appended.is_ok(),
        "{:?}",
        appended.map_err(|e| format!("{e:?}"))
    );
    let read = s
        .read(
            &tag_query("big"),
            ReadOptions {
                limit: Some(1),
                ..ReadOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(read.len(), 1);
    assert!(read[0].event.data == numbers, "read back another value");
}

/// A read asked for a negative number of events is refused as bad input
/// ([`Error::Invalid`], naming the limit), forwards and backwards, before
/// the database is asked: PostgreSQL's "LIMIT must not be negative" came
/// back as a bare database error. A limit of 0 reads nothing.
#[tokio::test]
async fn a_negative_read_limit_is_refused_as_bad_input() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    s.append(&[booked("booking:1")], None).await.unwrap();
    for backwards in [false, true] {
        for limit in [-1, i64::MIN] {
            let outcome = s
                .read(
                    &Query::all(),
                    ReadOptions {
                        limit: Some(limit),
                        backwards,
                        ..ReadOptions::default()
                    },
                )
                .await;
            assert!(
                matches!(&outcome, Err(Error::Invalid { what: "read options", why }) if why.contains("limit")),
                "limit {limit}, backwards {backwards}: {outcome:?}"
            );
        }
        let none = s
            .read(
                &Query::all(),
                ReadOptions {
                    limit: Some(0),
                    backwards,
                    ..ReadOptions::default()
                },
            )
            .await
            .unwrap();
        assert!(none.is_empty(), "limit 0, backwards {backwards}: {none:?}");
    }
}

/// What an append accepts reads back equal, on each of its paths: one
/// event under a one-item tag condition (its fields as parameters), two
/// under it (a JSON array), a condition of two items (the general path),
/// and no condition; under every strategy. Types, tags and JSON at the
/// edges of what the API accepts: quotes, braces, commas, the word NULL,
/// backslashes, non-ASCII, a tag of MAX_NAME_BYTES bytes that do not
/// compress, integers at the ends of i64 and u64, whole doubles that
/// serde_json writes with an exponent (`1e16`, which jsonb kept as the
/// integer 10000000000000000), JSON null as data, and metadata nested
/// MAX_JSON_NESTING deep.
#[tokio::test]
async fn an_event_reads_back_as_it_was_appended_on_every_path() {
    let (_db, pool) = db().await;
    // As long as a tag may be, in bytes that do not compress.
    let mut longest_tag = String::new();
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    while longest_tag.len() < pgonce::events::MAX_NAME_BYTES {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        longest_tag.push(char::from(b'!' + (x % 94) as u8));
    }
    // As deep as data may nest.
    let mut deepest = json!("bottom");
    for _ in 0..pgonce::events::MAX_JSON_NESTING {
        deepest = json!([deepest]);
    }
    let edge = |tag: &str| {
        Event::new("Ünïcödé \"type\" {x}, 'y'")
            .tag(tag)
            .tag("NULL")
            .tag("{a,b}")
            .tag("\"q\" \\ ü 🦀")
            .tag(longest_tag.clone())
            .data(json!({
                "none": null,
                "max": u64::MAX,
                "min": i64::MIN,
                "tenth": 0.1,
                "whole doubles": [1e16, -1e16, 2.5e18, 1e300, 3.0],
                "smallest": 5e-324,
                "deep": [[[{ "k": "\\\"'" }]]],
            }))
            .metadata(json!({ "who": "ü", "list": [] }))
    };
    for strategy in AppendStrategy::ALL {
        empty_log(&pool).await;
        let s = store(&pool, strategy);
        let general = |tag: &str| {
            Query::items([
                QueryItem::new().tags([tag]),
                QueryItem::new().tags([tag]).types(["Other"]),
            ])
            .unwrap()
        };
        let appends: Vec<(Vec<Event>, Option<AppendCondition>)> = vec![
            (
                vec![edge("rt:one")],
                Some(AppendCondition::new(tag_query("rt:one"), None)),
            ),
            (
                vec![edge("rt:two"), Event::new("Second").tag("rt:two")],
                Some(AppendCondition::new(tag_query("rt:two"), None)),
            ),
            (
                vec![edge("rt:general")],
                Some(AppendCondition::new(general("rt:general"), None)),
            ),
            (vec![edge("rt:none").data(json!(null))], None),
            (vec![edge("rt:deep").metadata(deepest.clone())], None),
        ];
        let mut appended = Vec::new();
        for (events, condition) in &appends {
            s.append(events, condition.as_ref()).await.unwrap();
            appended.extend(events.iter().cloned());
        }
        let stored: Vec<Event> = s
            .read(&Query::all(), ReadOptions::default())
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert_eq!(stored, appended, "{strategy:?}");
    }
}

// The three writers on overlapping tags (A and C on booking:123, B on
// booking:456) and the out-of-order commits (a decision and a catch-up
// reader facing a lower position still in flight) are replayed once, in the
// lab: `pgonce race events`, asserted by pgonce-lab's tests/races.rs.

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
        empty_log(&pool).await;
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
                        // Out of retries (SERIALIZABLE, a loaded machine):
                        // a typed outcome with nothing appended, which the
                        // oracle's count of accepted appends covers.
                        Err(Error::SerializationFailure { .. }) => failed += 1,
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

/// `writers` tasks, each appending `appends` events of its own tag one at a
/// time, holding each append open 0 to 2 ms (so commits come out of
/// position order) and rolling back one in ten.
fn spawn_writers(
    s: &EventStore,
    writers: usize,
    appends: usize,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..writers)
        .map(|w| {
            let s = s.clone();
            tokio::spawn(async move {
                for i in 0..appends {
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
            })
        })
        .collect()
}

/// A query is sent as one statement's parameters by a read and a
/// subscription, and PostgreSQL takes at most 65,535: past
/// `MAX_QUERY_ITEMS` a query is refused by every call that takes it, where
/// one of 70,000 items used to be accepted and then fail every read and
/// every poll. At the limit, decide, read and a subscription answer (the
/// items share their tag, so the decision stays within `MAX_LOCK_KEYS`).
#[tokio::test]
async fn a_query_past_the_most_items_is_refused_and_one_at_it_answers() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    s.append(&[Event::new("Type7").tag("t/7")], None)
        .await
        .unwrap();
    let items = |n: usize| {
        (0..n).map(|i| {
            QueryItem::new()
                .types([format!("Type{i}")])
                .tags(["t/7".to_string()])
        })
    };
    let query = |n: usize| Query::Items(items(n).collect());
    let too_many = query(pgonce::events::MAX_QUERY_ITEMS + 1);
    assert!(matches!(
        Query::items(items(pgonce::events::MAX_QUERY_ITEMS + 1)),
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        s.decide(&too_many).await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        s.read(&too_many, ReadOptions::default()).await,
        Err(Error::Invalid { .. })
    ));
    let config = SubscriptionConfig {
        query: too_many,
        ..Default::default()
    };
    assert!(matches!(
        s.subscribe(config).await,
        Err(Error::Invalid { .. })
    ));
    let most = query(pgonce::events::MAX_QUERY_ITEMS);
    assert_eq!(s.decide(&most).await.unwrap().events.len(), 1);
    assert_eq!(
        s.read(&most, ReadOptions::default()).await.unwrap().len(),
        1
    );
    let mut sub = s
        .subscribe(SubscriptionConfig {
            query: most,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(sub.run_once().await.unwrap().events.len(), 1);
}

/// Every distinct tag and type an append publishes or a condition checks
/// is an advisory key, an entry in PostgreSQL's shared lock table: past
/// `MAX_LOCK_KEYS` an append, a decision, a conditional append whose
/// events and condition together pass it, and an append in the caller's
/// transaction are refused before any key is taken, with nothing written,
/// where a batch of 100,000 keys used to fail with "out of shared memory"
/// and starve other sessions' locks while it filled the table. At the
/// limit each of them runs.
#[tokio::test]
async fn more_lock_keys_than_the_most_are_refused_and_nothing_is_written() {
    use pgonce::events::MAX_LOCK_KEYS;
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    // An event publishes its tags, its type and the "all" key.
    let tagged = |from: usize, n: usize| {
        (from..from + n).fold(Event::new("Wide"), |e, i| e.tag(format!("k/{i}")))
    };
    let one_tag_items =
        |n: usize| Query::items((0..n).map(|i| QueryItem::new().tags([format!("c/{i}")]))).unwrap();
    let refused = |r: pgonce::Result<_>| match r {
        Err(Error::Invalid { why, .. }) => assert!(why.contains("lock keys"), "{why}"),
        other => panic!("expected the lock-key limit, got {other:?}"),
    };

    refused(
        s.append(&[tagged(0, MAX_LOCK_KEYS - 1)], None)
            .await
            .map(|_| ()),
    );
    refused(
        s.begin_append(&[tagged(0, MAX_LOCK_KEYS - 1)], None)
            .await
            .map(|_| ()),
    );
    refused(
        s.decide(&one_tag_items(MAX_LOCK_KEYS + 1))
            .await
            .map(|_| ()),
    );
    let mut tx = pool.begin().await.unwrap();
    refused(
        s.append_in(&mut tx, &[tagged(0, MAX_LOCK_KEYS - 1)])
            .await
            .map(|_| ()),
    );
    drop(tx);
    // Each part within the limit, together past it.
    let half = MAX_LOCK_KEYS / 2 + 1;
    let condition = AppendCondition {
        fail_if_events_match: one_tag_items(half),
        after: None,
    };
    refused(
        s.append(&[tagged(0, half)], Some(&condition))
            .await
            .map(|_| ()),
    );
    assert_eq!(s.head().await.unwrap(), None, "nothing was written");

    // At the limit: the event's tags, its type and the "all" key.
    let widest = tagged(0, MAX_LOCK_KEYS - 2);
    let at = s.append(std::slice::from_ref(&widest), None).await.unwrap();
    let decision = s.decide(&one_tag_items(MAX_LOCK_KEYS)).await.unwrap();
    assert!(decision.events.is_empty());
    let back = s
        .read(
            &Query::items([QueryItem::new().tags(["k/0".to_string()])]).unwrap(),
            ReadOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].position, at.positions[0]);
    assert_eq!(back[0].event, widest);
    // The table lock takes no condition keys: the same append goes through.
    let table = store(&pool, AppendStrategy::TableLock);
    table
        .append(&[tagged(MAX_LOCK_KEYS, half)], Some(&condition))
        .await
        .unwrap();
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
    let writers = spawn_writers(&s, 6, 40);
    let mut seen = Vec::new();
    let mut done = false;
    while !done {
        done = writers.iter().all(|w| w.is_finished());
        // Catch up as far as possible (after the writers finished: fully).
        loop {
            let PollOutcome {
                events, counters, ..
            } = sub.run_once().await.unwrap();
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
    let committed = assert_every_committed_event_once_in_order(&pool, &seen).await;
    assert!(committed > 150);
}

/// `seen` is every committed position, in increasing order (so each once).
/// Returns how many there are.
async fn assert_every_committed_event_once_in_order(pool: &PgPool, seen: &[i64]) -> usize {
    let committed: Vec<i64> =
        sqlx::query_scalar("SELECT position FROM pgonce.events ORDER BY position")
            .fetch_all(pool)
            .await
            .unwrap();
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "delivered in increasing order, each once"
    );
    assert_eq!(seen, committed, "every committed event");
    committed.len()
}

/// The subscription wakes on NOTIFY: `next`, waiting after a poll that
/// found nothing, returns after an append though its poll interval is the
/// longest there is (12 h), so nothing but the notification can have woken
/// it, however slow the machine; after an unconditional append, a
/// conditional one of one event (its own insert, migration 0180) and a
/// conditional one of two. Each append waits until the waiting `next` has
/// polled.
#[tokio::test]
async fn next_is_woken_by_notify() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let mut sub = s
        .subscribe(SubscriptionConfig {
            poll_interval: pgonce::queue::MAX_WAIT,
            ..Default::default()
        })
        .await
        .unwrap();
    let (polled, mut polls) = tokio::sync::mpsc::unbounded_channel();
    sub.set_poll_hook(Some(Box::new(move |point, _| {
        if point == PollPoint::BeforeCommit {
            let _ = polled.send(());
        }
        Box::pin(async {})
    })));
    let (on_y, on_z) = (
        AppendCondition::new(tag_query("y"), None),
        AppendCondition::new(tag_query("z"), None),
    );
    let appends: [(Vec<Event>, Option<&AppendCondition>, Vec<i64>); 3] = [
        (vec![booked("x")], None, vec![1]),
        (vec![booked("y")], Some(&on_y), vec![2]),
        (vec![booked("z"), booked("z")], Some(&on_z), vec![3, 4]),
    ];
    for (events, condition, expected) in appends {
        // The poll that found the last append's events, told already.
        while polls.try_recv().is_ok() {}
        let waiter = tokio::spawn(async move {
            let next = sub.next().await;
            (sub, next)
        });
        tokio::time::timeout(FAILSAFE, polls.recv())
            .await
            .expect("waited two minutes for next to poll");
        s.append(&events, condition).await.unwrap();
        let (back, next) = tokio::time::timeout(FAILSAFE, waiter)
            .await
            .expect("woken by the notification, not by the 12 h poll")
            .unwrap();
        assert_eq!(positions(&next.unwrap()), expected);
        sub = back;
    }
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
/// lock that fails there (here: `statement_timeout` while another
/// transaction holds the tag's key exclusive; the session's `lock_timeout`
/// does not bound the append's locks) returns the error and leaves the pooled
/// connection idle, not inside an aborted transaction: the next append on
/// that same (only) connection succeeds and writes exactly one event.
#[tokio::test]
async fn a_failed_lock_leaves_the_connection_usable() {
    let (db, pool) = db().await;
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options().options([("statement_timeout", "200ms")]))
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

/// An append waits for its locks as long as it takes, as the strategies
/// promise, whatever lock_timeout the session inherited (an operator's
/// `ALTER ROLE ... SET lock_timeout`; here set on the session): with its
/// own transaction (advisory keys, the table lock) and inside the caller's
/// (`append_in`), it is still waiting at four times that timeout, goes
/// through once the holder commits, and the caller's statements after
/// `append_in` run with the session's value again. Inheriting it, each
/// append failed after 50 ms with PostgreSQL's 55P03 as a database error.
#[tokio::test]
async fn an_append_waits_for_its_locks_past_the_sessions_lock_timeout() {
    let (db, pool) = db().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (h, w) = (
        race.session("H").await.unwrap(),
        race.session("W").await.unwrap(),
    );
    w.set("lock_timeout", "50ms").await.unwrap();
    let key = pgonce::LockKey::new(pgonce::events::TAG_NAMESPACE, "inherited").unwrap();
    let hold_key = format!("SELECT pg_advisory_xact_lock({})", key.as_i64());
    let table = "LOCK TABLE pgonce.events IN EXCLUSIVE MODE";
    // The case, the strategy, what the holder holds, whether the append
    // runs in the caller's transaction (`append_in`), and the session's
    // default isolation (REPEATABLE READ: the transaction path, whose
    // BEGIN takes the locks, rather than the one-statement functions).
    let rc = "read committed";
    let rr = "repeatable read";
    let cases = [
        (
            "advisory",
            AppendStrategy::AdvisoryLocks,
            hold_key.as_str(),
            false,
            rc,
        ),
        ("table", AppendStrategy::TableLock, table, false, rc),
        (
            "append_in",
            AppendStrategy::AdvisoryLocks,
            hold_key.as_str(),
            true,
            rc,
        ),
        (
            "begin, advisory",
            AppendStrategy::AdvisoryLocks,
            hold_key.as_str(),
            false,
            rr,
        ),
        ("begin, table", AppendStrategy::TableLock, table, false, rr),
    ];
    for (case, strategy, hold, within, isolation) in cases {
        w.set("default_transaction_isolation", isolation)
            .await
            .unwrap();
        let mut holder = h.pool().begin().await.unwrap();
        let holding = sqlx::query(sqlx::AssertSqlSafe(hold.to_string())).execute(&mut *holder);
        race.step(&h, hold, holding).await.unwrap().unwrap();
        let events = store(w.pool(), strategy);
        let pool_w = w.pool().clone();
        let waiting = race
            .step_blocks(&w, case, async move {
                if !within {
                    events.append(&[booked("inherited")], None).await?;
                    return Ok::<_, Error>("50ms".to_string());
                }
                let mut tx = pool_w.begin().await?;
                events.append_in(&mut tx, &[booked("inherited")]).await?;
                let after: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(after)
            })
            .await
            .unwrap();
        let after = waiting
            .outlasts_then_commit(200, &h, holder)
            .await
            .unwrap_or_else(|e| panic!("{case}: {e}"))
            .unwrap();
        assert_eq!(after, "50ms", "{case}");
    }
    let read = store(&pool, AppendStrategy::AdvisoryLocks)
        .read(&tag_query("inherited"), ReadOptions::default())
        .await
        .unwrap();
    assert_eq!(read.len(), cases.len());
}

/// `statement_timeout` still bounds an append's wait for its locks (the
/// operator's ceiling, which the append does not lift): waiting for a tag's
/// key another transaction holds, with and without the caller's
/// transaction, the append fails once it runs out with the typed
/// `QueryCanceled` (SQLSTATE 57014), not a bare database error, and
/// appends nothing. It was `Error::Database`, which a caller could not
/// tell from a bug.
#[tokio::test]
async fn statement_timeout_ends_an_appends_wait_with_a_typed_error() {
    let (db, pool) = db().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (h, w) = (
        race.session("H").await.unwrap(),
        race.session("W").await.unwrap(),
    );
    w.set("statement_timeout", "2s").await.unwrap();
    let key = pgonce::LockKey::new(pgonce::events::TAG_NAMESPACE, "timed out").unwrap();
    let mut holder = h.pool().begin().await.unwrap();
    race.step(
        &h,
        "hold the tag's key",
        pgonce::lock::lock(&mut holder, key),
    )
    .await
    .unwrap()
    .unwrap();
    for within in [false, true] {
        let what = format!("append, within: {within}");
        let timeout = ("statement_timeout", Duration::from_secs(2));
        let waited = support::outcome_of_blocked_wait(&race, &w, "H", &what, timeout, || {
            let events = store(w.pool(), AppendStrategy::AdvisoryLocks);
            let pool_w = w.pool().clone();
            async move {
                if !within {
                    return events.append(&[booked("timed out")], None).await.map(drop);
                }
                let mut tx = pool_w.begin().await?;
                events
                    .append_in(&mut tx, &[booked("timed out")])
                    .await
                    .map(drop)
            }
        })
        .await;
        let Err(Error::QueryCanceled { message }) = &waited else {
            panic!("within: {within}: {waited:?}");
        };
        assert!(message.contains("statement timeout"), "{message}");
    }
    holder.rollback().await.unwrap();
    let read = store(&pool, AppendStrategy::AdvisoryLocks)
        .read(&tag_query("timed out"), ReadOptions::default())
        .await
        .unwrap();
    assert!(read.is_empty(), "nothing appended: {read:?}");
}

/// The lock strategies decide and append in one statement each, which runs
/// only under READ COMMITTED; on sessions that default to another isolation
/// level they take the transaction path instead, and conditions still hold:
/// a decision and an append go through, and an append on the stale decision
/// is refused.
#[tokio::test]
async fn sessions_defaulting_to_repeatable_read_take_the_transaction_path() {
    let (db, _pool) = db().await;
    let rr = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            db.options()
                .options([("default_transaction_isolation", "repeatable read")]),
        )
        .await
        .unwrap();
    for strategy in [AppendStrategy::AdvisoryLocks, AppendStrategy::TableLock] {
        let tag = format!("rr:{}", strategy.name());
        let events = store(&rr, strategy);
        let decision = events.decide(&tag_query(&tag)).await.unwrap();
        let condition = AppendCondition::new(tag_query(&tag), decision.after);
        events
            .append(&[booked(&tag)], Some(&condition))
            .await
            .unwrap();
        let stale = events.append(&[booked(&tag)], Some(&condition)).await;
        assert!(
            matches!(stale, Err(Error::AppendConditionFailed { .. })),
            "{strategy:?}: {stale:?}"
        );
        let read = events
            .read(&tag_query(&tag), ReadOptions::default())
            .await
            .unwrap();
        assert_eq!(read.len(), 1, "{strategy:?}");
    }
}

/// The same promise as above, raced: in sessions defaulting to REPEATABLE
/// READ, B's conditional append and decision read wait for A's in-flight
/// append on the tag, and once A commits B sees A's event. The
/// one-statement functions must refuse such a session (PO110): run there,
/// their check would read from the snapshot taken when B's statement
/// began, before A committed, and accept B's append over A's event.
#[tokio::test]
async fn a_repeatable_read_session_waiting_for_an_append_sees_it() {
    let (db, pool) = db().await;
    let rr = db
        .options()
        .options([("default_transaction_isolation", "repeatable read")]);
    for strategy in [AppendStrategy::AdvisoryLocks, AppendStrategy::TableLock] {
        for decide in [false, true] {
            empty_log(&pool).await;
            store(&pool, strategy)
                .append(&[booked("booking:1")], None)
                .await
                .unwrap();
            let race = Interleaving::new(rr.clone()).await.unwrap();
            let a = race.session("A").await.unwrap();
            let b = race.session("B").await.unwrap();
            let held = race
                .step(
                    &a,
                    "begin_append",
                    store(a.pool(), strategy).begin_append(&[booked("booking:1")], None),
                )
                .await
                .unwrap()
                .unwrap();
            let sb = store(b.pool(), strategy);
            let waiting = race
                .step_blocks(&b, if decide { "decide" } else { "append" }, async move {
                    let query = tag_query("booking:1");
                    if decide {
                        sb.decide(&query).await.map(|d| positions(&d.events))
                    } else {
                        let condition = AppendCondition::new(query, Some(1));
                        sb.append(&[booked("booking:1")], Some(&condition))
                            .await
                            .map(|a| a.positions)
                    }
                })
                .await
                .unwrap();
            assert_eq!(waiting.blocked_by(), ["A"], "{strategy:?}");
            held.commit().await.unwrap();
            let outcome = waiting.resume().await.unwrap();
            if decide {
                assert_eq!(outcome.unwrap(), vec![1, 2], "{strategy:?}");
            } else {
                assert!(
                    matches!(
                        &outcome,
                        Err(Error::AppendConditionFailed { matching, .. }) if matching == &vec![2]
                    ),
                    "{strategy:?}: {outcome:?}"
                );
            }
        }
    }
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
    #[derive(sqlx::FromRow)]
    struct ConnectionState {
        in_transaction: bool,
        advisory_locks: i64,
    }
    let ConnectionState {
        in_transaction,
        advisory_locks,
    } = sqlx::query_as(
        "SELECT pg_current_xact_id_if_assigned() IS NOT NULL AS in_transaction, \
                (SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory') \
                AS advisory_locks",
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

/// A decision read given up while it waits for an append in flight on its
/// keys: its statement finishes on the server once the append commits,
/// and its connection goes back to the pool outside any transaction,
/// holding no lock. The next decision sees the append.
#[tokio::test]
async fn a_decide_dropped_while_it_waits_leaves_its_connection_clean() {
    let (db, _pool) = db().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let st = |s: &pgonce_testkit::Session| store(s.pool(), AppendStrategy::AdvisoryLocks);
    let held = race
        .step(
            &a,
            "begin_append",
            st(&a).begin_append(&[booked("booking:1")], None),
        )
        .await
        .unwrap()
        .unwrap();
    let sb = st(&b);
    let waiting = race
        .step_blocks(&b, "decide", async move {
            sb.decide(&tag_query("booking:1")).await
        })
        .await
        .unwrap();
    support::give_up_then_end(&race, waiting, (&a, held.commit()), &b).await;

    let decision = st(&b).decide(&tag_query("booking:1")).await.unwrap();
    assert_eq!(decision.events.len(), 1);
}

// ------------------------------------------- late lower unconditional writer

/// How the lower writer A of [`late_lower_writer`] appends its event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LowerWriter {
    /// `begin_append` without a condition, committed later.
    BeginAppend,
    /// `append_in` inside the caller's SERIALIZABLE transaction.
    AppendInSerializable,
    /// `append_in` inside the caller's READ COMMITTED transaction.
    AppendInReadCommitted,
}

impl LowerWriter {
    const ALL: [LowerWriter; 3] = [
        LowerWriter::BeginAppend,
        LowerWriter::AppendInSerializable,
        LowerWriter::AppendInReadCommitted,
    ];
}

/// What happened in one run of [`late_lower_writer`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct LateLowerWriter {
    /// A's event committed.
    a_committed: bool,
    /// Why A's append or its commit failed, if it did.
    a_error: Option<Refused>,
    /// Who C's append waited for (empty: it did not wait).
    c_blocked_by: Vec<String>,
    /// C's conditional append committed.
    c_committed: bool,
    /// Why C's append or its commit failed, if it did.
    c_error: Option<Refused>,
    /// Committed conditional appends with a matching committed event below
    /// them and above their `after`: (the append's position, the event's).
    violations: Vec<(i64, i64)>,
}

/// Position 1 holds a committed `course:1` event; C decides on `course:1`
/// (`after` = 1). A appends a `course:1` event at position 2 with no
/// condition (`writer` says how) and does not commit; B commits position 3
/// (`course:2`); C appends `course:1` under "no `course:1` after 1" and
/// commits; then A commits. Under a blocking strategy C is seen waiting
/// for A (pg_locks) before A commits, and then fails its condition.
async fn late_lower_writer(strategy: AppendStrategy, writer: LowerWriter) -> LateLowerWriter {
    let (db, pool) = db().await;
    store(&pool, strategy)
        .append(&[course("course:1")], None)
        .await
        .unwrap();
    let race = Interleaving::new(db.options()).await.unwrap();
    let [a, b, c] = [
        race.session("A").await.unwrap(),
        race.session("B").await.unwrap(),
        race.session("C").await.unwrap(),
    ];
    let st = |s: &pgonce_testkit::Session| store(s.pool(), strategy);
    let decision = race
        .step(&c, "decide course:1", st(&c).decide(&tag_query("course:1")))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(decision.after, Some(1));

    // A: position 2, in flight.
    enum Held {
        Pending(pgonce::events::PendingAppend),
        Caller(sqlx::Transaction<'static, sqlx::Postgres>),
        Nothing,
    }
    let mut a_error = None;
    let held = match writer {
        LowerWriter::BeginAppend => {
            match race
                .step(
                    &a,
                    "append course:1 (no condition)",
                    st(&a).begin_append(&[course("course:1")], None),
                )
                .await
                .unwrap()
            {
                Ok(p) => Held::Pending(p),
                Err(e) => {
                    a_error = Some(Refused::from(&e));
                    Held::Nothing
                }
            }
        }
        LowerWriter::AppendInSerializable | LowerWriter::AppendInReadCommitted => {
            let level = if writer == LowerWriter::AppendInSerializable {
                IsolationLevel::Serializable
            } else {
                IsolationLevel::ReadCommitted
            };
            let mut tx = race
                .step(
                    &a,
                    &format!("BEGIN ISOLATION LEVEL {level}"),
                    pgonce::begin(a.pool(), level),
                )
                .await
                .unwrap()
                .unwrap();
            let sa = st(&a);
            match race
                .step(
                    &a,
                    "append_in course:1",
                    sa.append_in(&mut tx, &[course("course:1")]),
                )
                .await
                .unwrap()
            {
                Ok(_) => Held::Caller(tx),
                Err(e) => {
                    a_error = Some(Refused::from(&e));
                    tx.rollback().await.unwrap();
                    Held::Nothing
                }
            }
        }
    };
    // B: position 3, committed (under the table lock it waits for A).
    let b_waiting = if strategy == AppendStrategy::TableLock && !matches!(held, Held::Nothing) {
        let sb = st(&b);
        let waiting = race
            .step_blocks(&b, "append course:2", async move {
                sb.append(&[course("course:2")], None).await
            })
            .await
            .unwrap();
        Some(waiting)
    } else {
        race.step(
            &b,
            "append course:2",
            st(&b).append(&[course("course:2")], None),
        )
        .await
        .unwrap()
        .unwrap();
        None
    };

    // C: checks "no course:1 after 1" and commits, or waits for A.
    let condition = AppendCondition::new(tag_query("course:1"), decision.after);
    let sc = st(&c);
    let c_append = async move {
        sc.begin_append(&[course("course:1")], Some(&condition))
            .await?
            .commit()
            .await
    };
    let blocks = strategy != AppendStrategy::Serializable && !matches!(held, Held::Nothing);
    let (c_blocked_by, waiting, c_outcome) = if blocks {
        let waiting = race
            .step_blocks(&c, "append course:1 if none after 1, COMMIT", c_append)
            .await
            .unwrap();
        (waiting.blocked_by().to_vec(), Some(waiting), None)
    } else {
        let outcome = race
            .step(&c, "append course:1 if none after 1, COMMIT", c_append)
            .await
            .unwrap();
        (Vec::new(), None, Some(outcome))
    };
    let a_commit = match held {
        Held::Pending(p) => Some(
            race.step(&a, "COMMIT", p.commit())
                .await
                .unwrap()
                .map(|_| ()),
        ),
        Held::Caller(tx) => Some(
            race.step(&a, "COMMIT", tx.commit())
                .await
                .unwrap()
                .map_err(pgonce::Error::from),
        ),
        Held::Nothing => None,
    };
    if let Some(b) = b_waiting {
        b.resume().await.unwrap().unwrap();
    }
    let c_outcome = match waiting {
        Some(w) => w.resume().await.unwrap(),
        None => c_outcome.unwrap(),
    };
    let a_committed = matches!(a_commit, Some(Ok(())));
    if let Some(Err(e)) = a_commit {
        a_error = Some(Refused::from(&e));
    }
    let log = store(&pool, strategy)
        .read(&Query::all(), ReadOptions::default())
        .await
        .unwrap();
    let mut violations = Vec::new();
    if let Ok(at) = &c_outcome {
        for e in &log {
            if e.position > 1 && e.position < at[0] && tag_query("course:1").matches(&e.event) {
                violations.push((at[0], e.position));
            }
        }
    }
    LateLowerWriter {
        a_committed,
        a_error,
        c_blocked_by,
        c_committed: c_outcome.is_ok(),
        c_error: c_outcome.as_ref().err().map(Refused::from),
        violations,
    }
}

/// The case above, for each strategy and each kind of lower writer: no run
/// ends with both A and C committed (C's condition broken by A's event at
/// position 2). The blocking strategies make C wait for A and then fail its
/// condition; the serializable one lets C commit and aborts A at its commit
/// (SERIALIZABLE sees the cycle: C missed A's row, and A read the
/// conditional appends above position 2); `append_in` at READ COMMITTED is
/// refused under the serializable strategy, so only C commits.
#[tokio::test]
async fn a_lower_unconditional_write_committing_late_never_breaks_a_condition() {
    let mut runs = Vec::new();
    for strategy in AppendStrategy::ALL {
        for writer in LowerWriter::ALL {
            let run = late_lower_writer(strategy, writer).await;
            println!("{strategy:?}, {writer:?}: {run:?}");
            runs.push((strategy, writer, run));
        }
    }
    for (strategy, writer, run) in runs {
        {
            let what = format!("{strategy:?}, {writer:?}: {run:?}");
            assert!(run.violations.is_empty(), "{what}");
            assert!(!(run.a_committed && run.c_committed), "{what}");
            match (strategy, writer) {
                (AppendStrategy::Serializable, LowerWriter::AppendInReadCommitted) => {
                    assert!(!run.a_committed && run.c_committed, "{what}");
                    assert_eq!(run.a_error, Some(Refused::WrongIsolation), "{what}");
                }
                (AppendStrategy::Serializable, _) => {
                    assert!(run.c_blocked_by.is_empty(), "{what}");
                    assert!(run.c_committed || run.a_committed, "{what}");
                    let refused = if run.c_committed {
                        &run.a_error
                    } else {
                        &run.c_error
                    };
                    assert_eq!(refused, &Some(Refused::Serialization), "{what}");
                }
                _ => {
                    assert!(run.c_blocked_by.contains(&"A".to_string()), "{what}");
                    assert!(run.a_committed && !run.c_committed, "{what}");
                    assert_eq!(run.c_error, Some(Refused::Condition), "{what}");
                }
            }
        }
    }
}

// ------------------------------------------------- randomized mixed writers

fn mixed_plan(rng: &mut impl Rng, strategy: AppendStrategy) -> MixedTx {
    let kind = match rng.random_range(0..10) {
        0..=2 => MixedKind::ConditionSame,
        3 => MixedKind::ConditionOther,
        4 => MixedKind::ConditionType,
        5 => MixedKind::ConditionSameAppend,
        6 | 7 => MixedKind::Unconditional,
        _ => MixedKind::AppendIn(match (strategy, rng.random_range(0..4)) {
            (AppendStrategy::Serializable, 0) => IsolationLevel::ReadCommitted,
            (AppendStrategy::Serializable, _) | (_, 0) => IsolationLevel::Serializable,
            (_, 1) => IsolationLevel::RepeatableRead,
            _ => IsolationLevel::ReadCommitted,
        }),
    };
    MixedTx::new(kind, rng.random_bool(0.15))
}

/// Randomized mixed writers, each strategy: rounds of three or four
/// transactions (conditional on the query under test, conditional on
/// another tag with a matching event, conditional on the round's type,
/// conditional through the one-call append, unconditional, `append_in` in
/// a caller's transaction at a random accepted isolation level, some
/// rolled back), interleaved step by step in a random order. The oracle
/// above holds after every round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_mixed_writers_never_break_a_condition() {
    // The strategies run at once, each on its own database.
    let runs: Vec<_> = AppendStrategy::ALL
        .into_iter()
        .map(|strategy| tokio::spawn(mixed_rounds(strategy, mixed_plan, MIXED_ROUNDS)))
        .collect();
    for run in runs {
        let (strategy, violations, committed, refused) = run.await.unwrap();
        assert!(
            violations.is_empty(),
            "{strategy:?}: {} violations, first: {:?}",
            violations.len(),
            violations.first()
        );
        assert!(committed > MIXED_ROUNDS && refused > 0, "{strategy:?}");
    }
}

const MIXED_ROUNDS: usize = 2000;

/// A writer of a round whose writers use different strategies on one
/// database: conditions checked under a lock strategy (either one), the
/// other writers under any of the three, `append_in` at an isolation level
/// its strategy accepts.
fn mixed_strategies_plan(rng: &mut impl Rng, _: AppendStrategy) -> MixedTx {
    let locking =
        [AppendStrategy::TableLock, AppendStrategy::AdvisoryLocks][rng.random_range(0..2)];
    let any = AppendStrategy::ALL[rng.random_range(0..3)];
    let (kind, strategy) = match rng.random_range(0..10) {
        0 | 1 => (MixedKind::ConditionSame, locking),
        2 => (MixedKind::ConditionSameAppend, locking),
        3 => (MixedKind::ConditionType, locking),
        4 => (MixedKind::ConditionOther, locking),
        5 | 6 => (MixedKind::Unconditional, any),
        _ => {
            let level = match (any, rng.random_range(0..3)) {
                (AppendStrategy::Serializable, _) | (_, 0) => IsolationLevel::Serializable,
                (_, 1) => IsolationLevel::RepeatableRead,
                _ => IsolationLevel::ReadCommitted,
            };
            (MixedKind::AppendIn(level), any)
        }
    };
    let mut tx = MixedTx::new(kind, rng.random_bool(0.15));
    tx.strategy = Some(strategy);
    tx
}

/// Writers of different strategies on one database, as the module docs
/// allow ("Mixing strategies"): a condition checked under `TableLock` or
/// `AdvisoryLocks` holds against writers of every strategy (SERIALIZABLE
/// ones included, which wait for nobody), whatever the interleaving. The
/// rounds of the test above, each writer with its own strategy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_writers_of_every_strategy_never_break_a_locked_condition() {
    let (_, violations, committed, refused) = mixed_rounds(
        AppendStrategy::AdvisoryLocks,
        mixed_strategies_plan,
        MIXED_ROUNDS / 2,
    )
    .await;
    assert!(
        violations.is_empty(),
        "{} violations, first: {:?}",
        violations.len(),
        violations.first()
    );
    assert!(committed > MIXED_ROUNDS / 2 && refused > 0);
}

/// A violation found by [`mixed_rounds`]: the group's seed, the round, the
/// (append, event) positions, and the round's transactions.
type MixedViolation = (u64, usize, (i64, i64), Vec<MixedTx>);

/// `rounds` rounds of writers planned by `plan` (`strategy` for those it
/// gives none) on a fresh database, in groups of sessions running side by
/// side (different tags). Returns the violations and how many appends
/// committed and were refused.
async fn mixed_rounds(
    strategy: AppendStrategy,
    plan: fn(&mut rand::rngs::StdRng, AppendStrategy) -> MixedTx,
    rounds: usize,
) -> (AppendStrategy, Vec<MixedViolation>, usize, usize) {
    const GROUPS: usize = 4;
    let (db, pool) = db().await;
    let started = std::time::Instant::now();
    let mut groups = Vec::new();
    for g in 0..GROUPS {
        // Commits without waiting for the WAL flush: faster rounds, and
        // nothing the oracle looks at depends on durability.
        let options = db.options().options([("synchronous_commit", "off")]);
        let race = Interleaving::new(options).await.unwrap();
        let mut sessions = Vec::new();
        for s in 0..4 {
            sessions.push(race.session(&format!("g{g}s{s}")).await.unwrap());
        }
        let pool = pool.clone();
        let seed: u64 = rand::random();
        groups.push(tokio::spawn(async move {
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let (mut violations, mut committed, mut refused) = (Vec::new(), 0, 0);
            for r in (g..rounds).step_by(GROUPS) {
                let n = rng.random_range(3..=4);
                let plans = (0..n).map(|_| plan(&mut rng, strategy)).collect();
                let mut choose = |n| rng.random_range(0..n);
                let txs = mixed_round(&race, &sessions, strategy, r, plans, &mut choose).await;
                let log = store(&pool, strategy)
                    .read(&tag_query(&format!("r{r}:x")), ReadOptions::default())
                    .await
                    .unwrap();
                committed += txs.iter().filter(|t| t.committed).count();
                refused += txs.iter().filter(|t| t.refused.is_some()).count();
                for v in mixed_violations(&log, &txs) {
                    violations.push((seed, r, v, txs.clone()));
                }
            }
            (violations, committed, refused)
        }));
    }
    let (mut violations, mut committed, mut refused) = (Vec::new(), 0, 0);
    for g in groups {
        let (v, c, r) = g.await.unwrap();
        violations.extend(v);
        committed += c;
        refused += r;
    }
    println!(
        "{strategy:?}: {rounds} rounds in {:?}, {committed} appends committed, \
         {refused} refused, {} violations",
        started.elapsed(),
        violations.len()
    );
    (strategy, violations, committed, refused)
}

// ------------------------------------------------ catch-up under failures

/// A fault injected into one poll of a subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The poll's backend is terminated (`pg_terminate_backend`, waiting
    /// until it is gone): what a cut connection or a restart does to it.
    Cut,
    /// The poll stalls there and the caller drops its future.
    Drop,
}

/// The faults planned for the next poll, shared with the poll hook.
#[derive(Clone, Default)]
struct Faults {
    plan: std::sync::Arc<std::sync::Mutex<Option<(PollPoint, Fault)>>>,
    stalled: std::sync::Arc<tokio::sync::Notify>,
}

impl Faults {
    /// The hook that carries out the plan; `killer` terminates backends.
    fn hook(&self, killer: PgPool) -> PollHook {
        let faults = self.clone();
        Box::new(move |point, pid| {
            let fault = {
                let mut plan = faults.plan.lock().unwrap();
                match *plan {
                    Some((at, fault)) if at == point => {
                        *plan = None;
                        Some(fault)
                    }
                    _ => None,
                }
            };
            let (killer, stalled) = (killer.clone(), faults.stalled.clone());
            Box::pin(async move {
                match fault {
                    Some(Fault::Cut) => {
                        let gone: bool =
                            sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
                                .bind(pid)
                                .fetch_one(&killer)
                                .await
                                .unwrap();
                        assert!(gone);
                    }
                    Some(Fault::Drop) => {
                        stalled.notify_one();
                        std::future::pending::<()>().await;
                    }
                    None => {}
                }
            })
        })
    }

    /// One poll with `fault`: `None` when the poll was dropped.
    async fn poll(
        &self,
        sub: &mut pgonce::events::Subscription,
        fault: Option<(PollPoint, Fault)>,
    ) -> Option<pgonce::Result<Vec<StoredEvent>>> {
        *self.plan.lock().unwrap() = fault;
        let stalled = self.stalled.clone();
        let out = tokio::select! {
            biased;
            r = sub.run_once() => Some(r.map(|polled| polled.events)),
            _ = stalled.notified() => None,
        };
        *self.plan.lock().unwrap() = None;
        out
    }
}

/// Polls until a poll advances nothing and waits on no gap.
async fn drain(sub: &mut pgonce::events::Subscription) -> Vec<i64> {
    let mut seen = Vec::new();
    loop {
        let PollOutcome {
            events, counters, ..
        } = sub.run_once().await.unwrap();
        seen.extend(positions(&events));
        if counters.advanced == 0 && !counters.waiting_on_gap {
            return seen;
        }
    }
}

/// A poll cut off after its snapshot, or after it read the batch and
/// before it committed, or dropped by its caller at either point, hands
/// nothing out and leaves `horizon()` where it was: the same subscription
/// calling `next()` again, and a new one resumed from `horizon()`, both
/// receive events 1 to 3, once, in order.
#[tokio::test]
async fn a_poll_cut_or_dropped_midway_loses_no_event() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    for i in 0..3 {
        s.append(&[booked(&format!("b{i}"))], None).await.unwrap();
    }
    for point in [PollPoint::AfterSnapshot, PollPoint::BeforeCommit] {
        for fault in [Fault::Cut, Fault::Drop] {
            let what = format!("{fault:?} at {point:?}");
            let faults = Faults::default();
            let mut sub = s
                .subscribe(SubscriptionConfig {
                    listen: pgonce::Listen::Off,
                    ..Default::default()
                })
                .await
                .unwrap();
            sub.set_poll_hook(Some(faults.hook(pool.clone())));
            let out = faults.poll(&mut sub, Some((point, fault))).await;
            match fault {
                Fault::Cut => assert!(matches!(out, Some(Err(_))), "{what}: {out:?}"),
                Fault::Drop => assert!(out.is_none(), "{what}: {out:?}"),
            }
            assert_eq!(
                sub.horizon(),
                0,
                "{what}: the horizon moved past undelivered events"
            );
            let mut resumed = s
                .subscribe(SubscriptionConfig {
                    after: sub.horizon(),
                    listen: pgonce::Listen::Off,
                    ..Default::default()
                })
                .await
                .unwrap();
            let again = sub.next().await.unwrap();
            assert_eq!(positions(&again), [1, 2, 3], "{what}: the same reader");
            assert_eq!(drain(&mut sub).await, Vec::<i64>::new(), "{what}: once");
            assert_eq!(
                drain(&mut resumed).await,
                [1, 2, 3],
                "{what}: resumed from horizon()"
            );
        }
    }
}

/// Catch-up under concurrent writers (out-of-order commits, rollbacks)
/// while polls are cut or dropped at random points; after a failed poll
/// the reader either polls again or resumes a new subscription from
/// `horizon()`. It receives every committed event exactly once, in order.
#[tokio::test]
async fn catch_up_under_cut_and_dropped_polls_delivers_every_event_once_in_order() {
    let (_db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let config = SubscriptionConfig {
        batch: 3,
        listen: pgonce::Listen::Off,
        ..Default::default()
    };
    let faults = Faults::default();
    let mut sub = s.subscribe(config.clone()).await.unwrap();
    sub.set_poll_hook(Some(faults.hook(pool.clone())));
    let writers = spawn_writers(&s, 4, 50);
    // Faults come at random; every third poll has one until MIN_FAULTS
    // polls have failed, so the count does not depend on how fast the
    // writers run.
    const MIN_FAULTS: usize = 5;
    let (mut seen, mut failed, mut polls) = (Vec::new(), 0, 0usize);
    loop {
        let done = writers.iter().all(|w| w.is_finished());
        polls += 1;
        let force = failed < MIN_FAULTS && polls % 3 == 0;
        let (fault, resume) = {
            let mut rng = rand::rng();
            let point = if rng.random_bool(0.5) {
                PollPoint::AfterSnapshot
            } else {
                PollPoint::BeforeCommit
            };
            let fault = match rng.random_range(0..5) {
                0 => Some((point, Fault::Cut)),
                1 => Some((point, Fault::Drop)),
                2 | 3 if force => Some((point, Fault::Cut)),
                _ if force => Some((point, Fault::Drop)),
                _ => None,
            };
            (fault, rng.random_bool(0.5))
        };
        match faults.poll(&mut sub, fault).await {
            Some(Ok(events)) => {
                assert!(fault.is_none(), "{fault:?} did not fail the poll");
                seen.extend(positions(&events));
                if events.is_empty() {
                    if done && failed >= MIN_FAULTS {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            Some(Err(_)) | None => {
                assert!(fault.is_some());
                failed += 1;
                if resume {
                    let after = sub.horizon();
                    sub = s
                        .subscribe(SubscriptionConfig {
                            after,
                            ..config.clone()
                        })
                        .await
                        .unwrap();
                    sub.set_poll_hook(Some(faults.hook(pool.clone())));
                }
            }
        }
    }
    seen.extend(drain(&mut sub).await);
    let committed = assert_every_committed_event_once_in_order(&pool, &seen).await;
    println!("{committed} events delivered once in order through {failed} failed polls");
    assert!(
        committed > 150 && failed >= MIN_FAULTS,
        "{committed} events, {failed} failed polls"
    );
}

/// A SIREAD lock an append holds (pg_locks).
#[derive(Debug, sqlx::FromRow)]
struct SireadLock {
    relation: String,
    locktype: String,
}

/// A listener that loses its connection and cannot get a new one (here
/// its role may no longer log in) fails at once on every attempt. `next`
/// then waits out its poll interval before it polls again, as it would
/// have waited for a notification, instead of following every poll with
/// the next: within a few seconds of a 60 s interval, one poll before the
/// connection is found dead and at most one after.
#[tokio::test]
async fn a_listener_that_cannot_reconnect_leaves_next_waiting_not_polling_in_a_loop() {
    let (db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let mut sub = subscription_with_a_lost_listener(
        &db,
        &pool,
        &s,
        "pgonce_lost_listener",
        Duration::from_secs(60),
    )
    .await;
    let polls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = polls.clone();
    sub.set_poll_hook(Some(Box::new(move |point, _| {
        if point == PollPoint::AfterSnapshot {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Box::pin(async {})
    })));

    let waited = tokio::time::timeout(Duration::from_secs(3), sub.next()).await;
    assert!(waited.is_err(), "no event to deliver: {waited:?}");
    let polls = polls.load(std::sync::atomic::Ordering::SeqCst);
    assert!(polls <= 2, "{polls} polls in 3 s with a 60 s poll interval");
}

/// A listener that cannot reconnect (its role may no longer log in) fails
/// on every attempt, each counted in
/// `pgonce_events_subscription_failed_reconnects_total`; the log has the
/// first at warn with its error, then at most one warn line per minute,
/// the others at debug. The test waits for thirty failures (a 10 ms poll
/// interval) and bounds the warn lines by the time they took. (Each failed
/// reconnect was logged at warn, a line per poll interval for as long as
/// it lasted, and counted nowhere.)
#[tokio::test]
async fn a_listener_that_cannot_reconnect_logs_a_line_a_minute_and_counts_each_failure() {
    let (db, pool) = db().await;
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let sub = subscription_with_a_lost_listener(
        &db,
        &pool,
        &s,
        "pgonce_refused_listener",
        Duration::from_millis(10),
    )
    .await;

    let (metric, recorder) =
        support::count_of("pgonce_events_subscription_failed_reconnects_total");
    // On this single-threaded runtime the polling task records here too.
    let _local = metrics::set_default_local_recorder(&recorder);
    let logged = pgonce_testkit::logs::LogLines::default();
    let _logging = logged.capture();
    const FAILED: &str = "subscription listener cannot reconnect";
    let started = tokio::time::Instant::now();
    let mut sub = sub;
    let polling = tokio::spawn(async move {
        loop {
            let _ = sub.next().await;
        }
    });
    let failures_logged = || {
        logged.starting(tracing::Level::WARN, FAILED).len()
            + logged.starting(tracing::Level::DEBUG, FAILED).len()
    };
    until("thirty failed reconnects logged", || async {
        (failures_logged() >= 30).then_some(()).ok_or_else(|| {
            let counted = metric.load(std::sync::atomic::Ordering::SeqCst);
            format!("{} logged, {counted} counted", failures_logged())
        })
    })
    .await;
    let lasted = started.elapsed();

    let failed = metric.load(std::sync::atomic::Ordering::SeqCst);
    assert!(failed >= 30, "each failed reconnect counted: {failed}");
    let first = logged.assert_run_of_failures(
        failed,
        lasted,
        FAILED,
        "subscription listener still cannot reconnect",
        None,
    );
    assert!(first.error.is_some(), "with its error: {first:?}");

    // The role may log in again: once the listener LISTENs, an append's
    // notification reaches it, and the recovery is told once.
    sqlx::query("ALTER ROLE pgonce_refused_listener LOGIN")
        .execute(&pool)
        .await
        .unwrap();
    until("the listener LISTENing again", || async {
        match listening_as(&pool, "pgonce_refused_listener").await {
            0 => Err("no session of its role LISTENs"),
            _ => Ok(()),
        }
    })
    .await;
    s.append(&[booked("after the reconnect")], None)
        .await
        .unwrap();
    const BACK: &str = "subscription listener reconnected after ";
    until("the recovery logged", || async {
        match logged.starting(tracing::Level::INFO, BACK).len() {
            0 => Err("no line yet"),
            _ => Ok(()),
        }
    })
    .await;
    polling.abort();
    let back = logged.starting(tracing::Level::INFO, BACK);
    assert_eq!(back.len(), 1, "the recovery once: {back:?}");
}

/// A listener whose reconnect takes longer than the poll interval still
/// gets its connection back: the wait that times out to poll leaves the
/// reconnect where it is, and the next wait goes on with it. Driven with a
/// proxy that answers each new connection 300 ms late, ahead of a 20 ms
/// poll interval. (Each timeout dropped the reconnect, the next wait
/// started another, and none ever finished: the subscription polled
/// without a listener for good, and a loaded machine, where a login takes
/// longer than a short interval, did the same.)
#[tokio::test]
async fn a_reconnect_slower_than_the_poll_interval_gets_its_listener_back() {
    let (db, pool) = db().await;
    let late = NewConnections::ForwardLate(Duration::from_millis(300));
    let proxy = FaultProxy::start(db.options(), late).await.unwrap();
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let mut sub = s
        .subscribe(SubscriptionConfig {
            poll_interval: Duration::from_millis(20),
            listen: pgonce::Listen::Direct(Box::new(proxy.options())),
            ..Default::default()
        })
        .await
        .unwrap();
    let first = listening_pids(&pool).await;
    assert_eq!(first.len(), 1, "{first:?}");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(first[0])
        .execute(&pool)
        .await
        .unwrap();
    let polling = tokio::spawn(async move {
        loop {
            let _ = sub.next().await;
        }
    });

    until("a new listener LISTENing", || async {
        let now = listening_pids(&pool).await;
        match now.iter().any(|pid| !first.contains(pid)) {
            true => Ok(()),
            false => Err(format!("LISTENing: {now:?}, the first was {first:?}")),
        }
    })
    .await;
    polling.abort();
}

/// The backend pids of this database's sessions LISTENing.
async fn listening_pids(pool: &PgPool) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%' ORDER BY pid",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Checks `done` every 10 ms until it is `Ok`. A wait for what never comes
/// fails after two minutes, far past any busy machine's delay, with what
/// was seen last, instead of holding its test binary until it is killed.
async fn until<E: std::fmt::Debug, F: std::future::Future<Output = Result<(), E>>>(
    what: &str,
    mut done: impl FnMut() -> F,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let seen = match done().await {
            Ok(()) => return,
            Err(seen) => seen,
        };
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited two minutes for {what}; seen last: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A subscription of `s` polling every `poll_interval` whose listener
/// (LISTENing as `role`, created here) has lost its connection and cannot
/// get a new one: the role may no longer log in, and its session was
/// terminated.
async fn subscription_with_a_lost_listener(
    db: &ScratchDatabase,
    pool: &PgPool,
    s: &EventStore,
    role: &str,
    poll_interval: Duration,
) -> Subscription {
    // `role` is one of this file's names, not input.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE ROLE {role} LOGIN")))
        .execute(pool)
        .await
        .unwrap();
    let sub = s
        .subscribe(SubscriptionConfig {
            poll_interval,
            listen: pgonce::Listen::Direct(Box::new(db.options().username(role))),
            ..Default::default()
        })
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("ALTER ROLE {role} NOLOGIN")))
        .execute(pool)
        .await
        .unwrap();
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
    )
    .bind(role)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(killed, [true]);
    sub
}

/// How many sessions of `role` are LISTENing.
async fn listening_as(pool: &PgPool, role: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(role)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Under the serializable strategy an unconditional append's read of the
/// conditional appends above it goes through the partial index: it holds
/// SIREAD locks on that index and none on the whole table (which would make
/// it conflict with every concurrent append, whatever its tags).
#[tokio::test]
async fn the_read_above_an_append_locks_the_conditional_index_not_the_table() {
    let (db, pool) = db().await;
    let s = store(&pool, AppendStrategy::Serializable);
    for i in 0..20 {
        let condition = AppendCondition::new(tag_query(&format!("c{i}")), None);
        s.append(&[booked(&format!("c{i}"))], Some(&condition))
            .await
            .unwrap();
        s.append(&[booked(&format!("u{i}"))], None).await.unwrap();
    }
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options())
        .await
        .unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&one)
        .await
        .unwrap();
    let pending = store(&one, AppendStrategy::Serializable)
        .begin_append(&[booked("u-new")], None)
        .await
        .unwrap();
    let locks: Vec<SireadLock> = sqlx::query_as(
        "SELECT relation::regclass::text AS relation, locktype FROM pg_locks \
         WHERE pid = $1 AND mode = 'SIReadLock' AND relation IS NOT NULL",
    )
    .bind(pid)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        locks
            .iter()
            .any(|l| l.relation == "pgonce.events_conditional"),
        "{locks:?}"
    );
    assert!(
        !locks
            .iter()
            .any(|l| l.relation == "pgonce.events" && l.locktype == "relation"),
        "{locks:?}"
    );
    pending.commit().await.unwrap();
}

/// `Subscription::next` waits for a notification with a timeout, and the
/// listener's reconnect after a lost connection runs inside that wait. A
/// timeout that fires while the new connection's LISTEN has run on the
/// server but its answer is not read yet drops the connection where it
/// is, and it went back to the pool it came from still LISTENing: the
/// application's pool, with `Listen::Pool`. Driven here: the LISTEN's
/// answer is held back until the subscription has polled again (after
/// the timeout); the next connection the application takes from the pool
/// must not be LISTENing. Before, it was the abandoned one, LISTENing on
/// the event store's channel.
#[tokio::test]
async fn a_reconnect_cut_short_by_the_wait_leaves_no_listening_connection_in_the_pool() {
    let (db, plain) = db().await;
    let proxy = FaultProxy::start(db.options(), NewConnections::Forward)
        .await
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(proxy.options())
        .await
        .unwrap();
    let s = store(&pool, AppendStrategy::AdvisoryLocks);
    let mut sub = s
        .subscribe(SubscriptionConfig {
            poll_interval: Duration::from_millis(300),
            ..Default::default()
        })
        .await
        .unwrap();
    // The hook tells of each poll; once stopping is set, it waits at the
    // poll's snapshot until told to go on.
    let (polled, mut polls) = tokio::sync::mpsc::unbounded_channel();
    let stopping = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let go = std::sync::Arc::new(tokio::sync::Notify::new());
    sub.set_poll_hook(Some({
        let (stopping, go) = (stopping.clone(), go.clone());
        Box::new(move |point, _pid| {
            let (polled, stopping, go) = (polled.clone(), stopping.clone(), go.clone());
            Box::pin(async move {
                if point != PollPoint::AfterSnapshot {
                    return;
                }
                let stop = stopping.swap(false, std::sync::atomic::Ordering::SeqCst);
                let _ = polled.send(stop);
                if stop {
                    go.notified().await;
                }
            })
        })
    }));
    let subscriber = tokio::spawn(async move {
        loop {
            sub.next().await.unwrap();
        }
    });
    polls.recv().await.unwrap();
    let listener_pid = tokio::time::timeout(FAILSAFE, async {
        loop {
            let pid: Option<i32> = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity \
                 WHERE datname = current_database() AND query LIKE 'LISTEN%' AND state = 'idle'",
            )
            .fetch_optional(&plain)
            .await
            .unwrap();
            if let Some(pid) = pid {
                break pid;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("waited two minutes for the listener LISTENing");

    // What the server answers the next LISTEN on a connection through
    // the proxy is held back.
    let held = proxy.hold_answer_to(|sent| sent.windows(6).any(|w| w == b"LISTEN"));
    stopping.store(true, std::sync::atomic::Ordering::SeqCst);
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(listener_pid)
        .execute(&plain)
        .await
        .unwrap();
    // The listener reconnects and its LISTEN's answer is held back; the
    // wait times out and the subscription polls again.
    while !polls.recv().await.unwrap() {}
    held.release();

    let mut conn = pool.acquire().await.unwrap();
    let channels: Vec<String> = sqlx::query_scalar("SELECT pg_listening_channels()")
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    assert_eq!(channels, Vec::<String>::new());
    drop(conn);
    go.notify_one();
    subscriber.abort();
}
