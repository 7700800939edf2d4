//! `pgonce race events`: the event-store seed's three writers, step by
//! step, under each
//! append strategy. A appends booking:123, B booking:456, C booking:123; all
//! three decided "no booking yet" before anyone appended, so C must fail.
//! Then the out-of-order-commit cases: a decision read while a lower
//! position is still in flight, and a catch-up reader facing the same gap.

use pgonce::Error;
use pgonce::events::{
    AppendCondition, AppendStrategy, Decision, Event, EventStore, EventStoreConfig, Query,
    ReadOptions, SubscriptionConfig,
};
use pgonce_testkit::{Interleaving, Session};
use serde_json::json;

use super::timeline_rows;
use crate::report::{Report, Row};
use crate::scratch::RunDatabase;

pub async fn run(db: &RunDatabase) -> anyhow::Result<Report> {
    let mut report = Report::new("race", "events", db.environment().await?);
    for strategy in AppendStrategy::ALL {
        let (row, timeline, held) = three_writers(db, strategy).await?;
        report.results.push(row);
        report
            .sections
            .insert(format!("timeline: {}", strategy.name()), timeline);
        report.verdict.check(
            held,
            format!(
                "{}: one booking per tag; C's conflicting append failed",
                strategy.name()
            ),
        );
    }
    for strategy in AppendStrategy::ALL {
        let (row, timeline, held) = late_lower_position_decision(db, strategy).await?;
        report.results.push(row);
        report.sections.insert(
            format!("timeline: out-of-order decision, {}", strategy.name()),
            timeline,
        );
        report.verdict.check(
            held,
            format!(
                "{}: the decision read waited for the in-flight lower position and saw it",
                strategy.name()
            ),
        );
    }
    let (row, timeline, held) = late_lower_position_catch_up(db).await?;
    report.results.push(row);
    report
        .sections
        .insert("timeline: out-of-order catch-up".into(), timeline);
    report.verdict.check(
        held,
        "catch-up delivered 1 then 2 after 1 committed late, and skipped nothing",
    );
    Ok(report)
}

fn store(session: &Session, strategy: AppendStrategy) -> EventStore {
    EventStore::new(
        session.pool().clone(),
        EventStoreConfig {
            strategy,
            ..Default::default()
        },
    )
    .expect("valid config")
}

fn booking(tag: &str) -> Vec<Event> {
    vec![
        Event::new("BookingPlaced")
            .tag(tag)
            .data(json!({ "booking": tag })),
    ]
}

fn on(tag: &str) -> Query {
    Query::item(Vec::<String>::new(), [tag]).expect("valid query")
}

fn condition(tag: &str, d: &Decision) -> AppendCondition {
    AppendCondition::new(on(tag), d.after)
}

fn outcome<T>(r: &Result<T, Error>) -> String {
    match r {
        Ok(_) => "committed".into(),
        Err(Error::AppendConditionFailed { matching, .. }) => {
            format!("condition failed (saw {matching:?})")
        }
        Err(Error::SerializationFailure { sqlstate, .. }) => {
            format!("serialization failure ({sqlstate})")
        }
        Err(e) => format!("error: {e}"),
    }
}

async fn clean(db: &RunDatabase) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE pgonce.events RESTART IDENTITY")
        .execute(db.pool())
        .await?;
    Ok(())
}

async fn three_writers(
    db: &RunDatabase,
    strategy: AppendStrategy,
) -> anyhow::Result<(Row, Vec<Row>, bool)> {
    clean(db).await?;
    let race = Interleaving::new(db.options()).await?;
    let (a, b, c) = (
        race.session("A").await?,
        race.session("B").await?,
        race.session("C").await?,
    );
    let d_a = race
        .step(
            &a,
            "decide on booking:123",
            store(&a, strategy).decide(&on("booking:123")),
        )
        .await??;
    let d_b = race
        .step(
            &b,
            "decide on booking:456",
            store(&b, strategy).decide(&on("booking:456")),
        )
        .await??;
    let d_c = race
        .step(
            &c,
            "decide on booking:123",
            store(&c, strategy).decide(&on("booking:123")),
        )
        .await??;
    let (c_a, c_b, c_c) = (
        condition("booking:123", &d_a),
        condition("booking:456", &d_b),
        condition("booking:123", &d_c),
    );
    let pending_a = race
        .step(
            &a,
            "check + insert booking:123",
            store(&a, strategy).begin_append(&booking("booking:123"), Some(&c_a)),
        )
        .await??;
    let mut parallel = vec!["A"];
    let mut waited = Vec::new();
    let (b_result, c_result): (Result<Vec<i64>, Error>, Result<Vec<i64>, Error>);
    let (mut b_retried, mut c_retried) = (String::new(), String::new());
    match strategy {
        AppendStrategy::AdvisoryLocks => {
            let pending_b = race
                .step(
                    &b,
                    "check + insert booking:456",
                    store(&b, strategy).begin_append(&booking("booking:456"), Some(&c_b)),
                )
                .await??;
            parallel.push("B");
            let sc = store(&c, strategy);
            let cc = c_c.clone();
            let c_blocked = race
                .step_blocks(&c, "lock booking:123 + check + insert", async move {
                    sc.append(&booking("booking:123"), Some(&cc))
                        .await
                        .map(|a| a.positions)
                })
                .await?;
            waited.push(format!("C on {}", c_blocked.blocked_by().join(", ")));
            race.step(&a, "COMMIT", pending_a.commit()).await??;
            b_result = race.step(&b, "COMMIT", pending_b.commit()).await?;
            c_result = c_blocked.resume().await?;
        }
        AppendStrategy::Serializable => {
            let pending_b = race
                .step(
                    &b,
                    "check + insert booking:456",
                    store(&b, strategy).begin_append(&booking("booking:456"), Some(&c_b)),
                )
                .await??;
            let pending_c = race
                .step(
                    &c,
                    "check + insert booking:123",
                    store(&c, strategy).begin_append(&booking("booking:123"), Some(&c_c)),
                )
                .await??;
            parallel.extend(["B", "C"]);
            race.step(&a, "COMMIT", pending_a.commit()).await??;
            b_result = race.step(&b, "COMMIT", pending_b.commit()).await?;
            c_result = race.step(&c, "COMMIT", pending_c.commit()).await?;
        }
        AppendStrategy::TableLock => {
            let sb = store(&b, strategy);
            let cb = c_b.clone();
            let b_blocked = race
                .step_blocks(&b, "LOCK TABLE + check + insert booking:456", async move {
                    sb.append(&booking("booking:456"), Some(&cb)).await
                })
                .await?;
            waited.push(format!("B on {}", b_blocked.blocked_by().join(", ")));
            let sc = store(&c, strategy);
            let cc = c_c.clone();
            let c_blocked = race
                .step_blocks(&c, "LOCK TABLE + check + insert booking:123", async move {
                    sc.append(&booking("booking:123"), Some(&cc)).await
                })
                .await?;
            waited.push(format!("C on {}", c_blocked.blocked_by().join(", ")));
            race.step(&a, "COMMIT", pending_a.commit()).await??;
            b_result = b_blocked.resume().await?.map(|a| a.positions);
            c_result = c_blocked.resume().await?.map(|a| a.positions);
        }
    }
    let b_first = outcome(&b_result);
    let c_first = outcome(&c_result);
    // What the strategy's retry does with a serialization failure.
    if matches!(&b_result, Err(e) if e.is_retryable()) {
        let r = store(&b, strategy)
            .append(&booking("booking:456"), Some(&c_b))
            .await;
        b_retried = format!(", retried: {}", outcome(&r));
        race.note(&b, &format!("retry: {}", outcome(&r)));
    }
    if matches!(&c_result, Err(e) if e.is_retryable()) {
        let r = store(&c, strategy)
            .append(&booking("booking:123"), Some(&c_c))
            .await;
        c_retried = format!(", retried: {}", outcome(&r));
        race.note(&c, &format!("retry: {}", outcome(&r)));
    }
    let log = EventStore::new(db.pool().clone(), EventStoreConfig::default())?
        .read(&Query::all(), ReadOptions::default())
        .await?;
    let final_log: Vec<String> = log
        .iter()
        .map(|e| format!("{}:{}", e.position, e.event.tags.join("+")))
        .collect();
    let per_tag = |t: &str| log.iter().filter(|e| e.event.tags[0] == t).count();
    let held = per_tag("booking:123") == 1 && per_tag("booking:456") == 1;
    let failed: Vec<&str> = [("B", &b_first), ("C", &c_first)]
        .into_iter()
        .filter(|(_, o)| *o != "committed")
        .map(|(s, _)| s)
        .collect();
    let row = Row::new(strategy.name())
        .with("case", "three writers: A 123, B 456, C 123")
        .with("parallel", parallel.join(", "))
        .with(
            "waited",
            if waited.is_empty() {
                "nobody".into()
            } else {
                waited.join("; ")
            },
        )
        .with(
            "failed",
            if failed.is_empty() {
                "nobody".into()
            } else {
                failed.join(", ")
            },
        )
        .with("a", "committed")
        .with("b", format!("{b_first}{b_retried}"))
        .with("c", format!("{c_first}{c_retried}"))
        .with("final_log", final_log.join(" "))
        .with("invariant_held", held);
    Ok((row, timeline_rows(strategy.name(), &race.timeline()), held))
}

/// W1 inserts booking:9 at position 1 and stays open; W2 appends position 2
/// and commits; R's decision read on booking:9 must wait for W1 and see it.
async fn late_lower_position_decision(
    db: &RunDatabase,
    strategy: AppendStrategy,
) -> anyhow::Result<(Row, Vec<Row>, bool)> {
    clean(db).await?;
    let race = Interleaving::new(db.options()).await?;
    let (w1, w2, r) = (
        race.session("W1").await?,
        race.session("W2").await?,
        race.session("R").await?,
    );
    let p1 = race
        .step(
            &w1,
            "insert booking:9 (position 1), no COMMIT yet",
            store(&w1, strategy).begin_append(&booking("booking:9"), None),
        )
        .await??;
    let mut w2_note = "appended position 2 and committed";
    if strategy != AppendStrategy::TableLock {
        race.step(
            &w2,
            "append other (position 2), COMMIT",
            store(&w2, strategy).append(&booking("other"), None),
        )
        .await??;
    } else {
        w2_note = "skipped: the table lock makes W2 wait for W1";
    }
    let sr = store(&r, strategy);
    let waiting = race
        .step_blocks(&r, "decide on booking:9", async move {
            sr.decide(&on("booking:9")).await
        })
        .await?;
    let blocked_by = waiting.blocked_by().join(", ");
    race.step(&w1, "COMMIT", p1.commit()).await??;
    let decision = waiting.resume().await??;
    let saw: Vec<i64> = decision.events.iter().map(|e| e.position).collect();
    let stale = store(&r, strategy)
        .append(
            &booking("booking:9"),
            Some(&AppendCondition::new(on("booking:9"), Some(0))),
        )
        .await;
    race.note(
        &r,
        &format!("a stale condition (after 0): {}", outcome(&stale)),
    );
    let held = saw == [1] && matches!(stale, Err(Error::AppendConditionFailed { .. }));
    let row = Row::new(strategy.name())
        .with("case", "out-of-order: decision while position 1 in flight")
        .with("w2", w2_note)
        .with("waited", format!("R on {blocked_by}"))
        .with(
            "decision_saw",
            format!("{saw:?}, after {:?}", decision.after),
        )
        .with("invariant_held", held);
    Ok((row, timeline_rows(strategy.name(), &race.timeline()), held))
}

/// Position 2 commits while 1 is in flight: the catch-up reader delivers
/// nothing, then 1 and 2 in order once 1 commits.
async fn late_lower_position_catch_up(db: &RunDatabase) -> anyhow::Result<(Row, Vec<Row>, bool)> {
    clean(db).await?;
    let strategy = AppendStrategy::AdvisoryLocks;
    let race = Interleaving::new(db.options()).await?;
    let (w1, w2, r) = (
        race.session("W1").await?,
        race.session("W2").await?,
        race.session("R").await?,
    );
    let mut sub = store(&r, strategy)
        .subscribe(SubscriptionConfig {
            listen: false,
            ..Default::default()
        })
        .await?;
    let p1 = race
        .step(
            &w1,
            "insert position 1, no COMMIT yet",
            store(&w1, strategy).begin_append(&booking("a"), None),
        )
        .await??;
    race.step(
        &w2,
        "append position 2, COMMIT",
        store(&w2, strategy).append(&booking("b"), None),
    )
    .await??;
    let (first, c1) = race.step(&r, "catch-up poll", sub.run_once()).await??;
    race.note(
        &r,
        &format!(
            "delivered {:?}, waiting on gap: {}",
            first.iter().map(|e| e.position).collect::<Vec<_>>(),
            c1.waiting_on_gap
        ),
    );
    race.step(&w1, "COMMIT", p1.commit()).await??;
    let (second, _) = race.step(&r, "catch-up poll", sub.run_once()).await??;
    let second: Vec<i64> = second.iter().map(|e| e.position).collect();
    race.note(&r, &format!("delivered {second:?}"));
    let held = first.is_empty() && second == [1, 2];
    let row = Row::new("catch-up")
        .with("case", "out-of-order: 2 commits before 1")
        .with("first_poll", "nothing (gap at 1)")
        .with("second_poll", format!("{second:?}"))
        .with("invariant_held", held);
    Ok((row, timeline_rows("catch-up", &race.timeline()), held))
}
