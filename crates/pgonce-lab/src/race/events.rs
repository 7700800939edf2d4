//! `pgonce race events`: the DCB event store's three writers, step by
//! step, under each append strategy. A appends booking:123, B booking:456,
//! C booking:123; all three decided "no booking yet" before anyone
//! appended, so C must fail. Then the out-of-order-commit cases: a decision
//! read while a lower position is still in flight, and a catch-up reader
//! facing the same gap (and a rolled-back position).
//!
//! [`replay`] returns an [`EventsRace`], what each case showed; `report`
//! renders it. The lab's tests assert on the former.

use std::time::Duration;

use pgonce::Error;
use pgonce::events::{
    AppendCondition, AppendStrategy, Decision, Event, EventStore, EventStoreConfig, Query,
    ReadOptions, SubscriptionConfig,
};
use pgonce_testkit::{Interleaving, Session, Step};
use serde_json::json;

use super::timeline_rows;
use crate::report::{Environment, Report, Row};
use crate::scratch::RunDatabase;

/// What became of one append attempt (or of its COMMIT).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AppendOutcome {
    /// The append committed.
    Committed {
        /// Positions the append wrote, in order.
        positions: Vec<i64>,
    },
    /// The condition found these matching positions: nothing written.
    ConditionFailed {
        /// Positions of the events that matched the condition.
        matching: Vec<i64>,
    },
    /// PostgreSQL aborted the transaction (40001, 40P01): nothing written.
    SerializationFailure {
        /// The SQLSTATE: `40001` or `40P01`.
        sqlstate: String,
    },
    /// Any other error, as its message.
    Failed {
        /// The error's message.
        error: String,
    },
}

impl AppendOutcome {
    pub(crate) fn of(result: Result<Vec<i64>, Error>) -> AppendOutcome {
        match result {
            Ok(positions) => AppendOutcome::Committed { positions },
            Err(Error::AppendConditionFailed { matching, .. }) => {
                AppendOutcome::ConditionFailed { matching }
            }
            Err(Error::SerializationFailure { sqlstate, .. }) => {
                AppendOutcome::SerializationFailure {
                    sqlstate: sqlstate.to_string(),
                }
            }
            Err(e) => AppendOutcome::Failed {
                error: e.to_string(),
            },
        }
    }

    /// Whether the append committed.
    pub fn committed(&self) -> bool {
        matches!(self, AppendOutcome::Committed { .. })
    }

    /// Positions written, none unless committed.
    pub(crate) fn positions(&self) -> &[i64] {
        match self {
            AppendOutcome::Committed { positions } => positions,
            _ => &[],
        }
    }

    /// Whether PostgreSQL aborted it (a serialization failure or deadlock).
    pub fn is_serialization_failure(&self) -> bool {
        matches!(self, AppendOutcome::SerializationFailure { .. })
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            AppendOutcome::Committed { .. } => "committed".into(),
            AppendOutcome::ConditionFailed { matching } => {
                format!("condition failed (saw {matching:?})")
            }
            AppendOutcome::SerializationFailure { sqlstate } => {
                format!("serialization failure ({sqlstate})")
            }
            AppendOutcome::Failed { error } => format!("error: {error}"),
        }
    }
}

/// One event of the log at the end of a case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedEvent {
    pub(crate) position: i64,
    pub(crate) tags: Vec<String>,
}

/// The whole log, by position.
pub(crate) async fn read_log(db: &RunDatabase) -> anyhow::Result<Vec<LoggedEvent>> {
    Ok(
        EventStore::new(db.pool().clone(), EventStoreConfig::default())?
            .read(&Query::all(), ReadOptions::default())
            .await?
            .into_iter()
            .map(|e| LoggedEvent {
                position: e.position,
                tags: e.event.tags,
            })
            .collect(),
    )
}

pub(crate) fn show_log(log: &[LoggedEvent]) -> String {
    log.iter()
        .map(|e| format!("{}:{}", e.position, e.tags.join("+")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A session seen waiting, and for whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wait {
    pub(crate) session: String,
    pub(crate) blocked_by: Vec<String>,
}

/// The three writers under one strategy.
#[derive(Debug, Clone)]
pub struct ThreeWriters {
    /// The append strategy all three writers used.
    pub strategy: AppendStrategy,
    /// Sessions whose appends were open at the same time.
    pub parallel: Vec<String>,
    /// Sessions seen waiting, and for whom.
    pub waits: Vec<Wait>,
    /// B's first attempt, on booking:456 (A always commits).
    pub b: AppendOutcome,
    /// C's first attempt, on A's booking:123.
    pub c: AppendOutcome,
    /// What the strategy's retry did for B after a serialization failure.
    pub b_retry: Option<AppendOutcome>,
    /// What the strategy's retry did for C after a serialization failure.
    pub c_retry: Option<AppendOutcome>,
    /// The event log at the end, by position.
    pub log: Vec<LoggedEvent>,
    pub(crate) timeline: Vec<Step>,
}

impl ThreeWriters {
    /// Events in the log whose first tag is `tag`.
    pub fn bookings(&self, tag: &str) -> usize {
        self.log.iter().filter(|e| e.tags[0] == tag).count()
    }

    /// Whom `session` was seen waiting for, if it waited.
    pub fn waited_for(&self, session: &str) -> Option<&[String]> {
        self.waits
            .iter()
            .find(|w| w.session == session)
            .map(|w| w.blocked_by.as_slice())
    }

    /// One booking per tag: C's conflicting append failed.
    pub fn invariant_held(&self) -> bool {
        self.bookings("booking:123") == 1 && self.bookings("booking:456") == 1
    }
}

/// A decision read on booking:9 while W1's position 1 (booking:9) is in
/// flight and W2's position 2 has committed.
#[derive(Debug, Clone)]
pub struct LateDecision {
    /// The append strategy of the writers and of the decision.
    pub strategy: AppendStrategy,
    /// Whether W2 appended position 2 before the decision (under the table
    /// lock it would only wait for W1).
    pub(crate) w2_appended: bool,
    /// What a plain read saw at that moment: the hazard a decision avoids.
    pub plain_read_saw: Vec<i64>,
    /// Whom R's decision was seen waiting for.
    pub r_waited_for: Vec<String>,
    /// Positions R's decision saw on booking:9.
    pub decision_saw: Vec<i64>,
    pub(crate) decision_after: Option<i64>,
    /// An append conditioned on `after = 0`, which must fail.
    pub stale: AppendOutcome,
    /// An append conditioned on the decision's own `after`, which holds.
    pub fresh: AppendOutcome,
    pub(crate) timeline: Vec<Step>,
}

impl LateDecision {
    /// The plain read saw nothing, the decision saw position 1, the stale
    /// append failed and the fresh one committed.
    pub fn invariant_held(&self) -> bool {
        self.plain_read_saw.is_empty()
            && self.decision_saw == [1]
            && matches!(self.stale, AppendOutcome::ConditionFailed { .. })
            && self.fresh.committed()
    }
}

/// A catch-up reader facing a gap: position 2 commits while 1 is in
/// flight; then 3 is rolled back while 4 commits.
#[derive(Debug, Clone)]
pub struct CatchUp {
    /// What the first poll delivered, while 1 was in flight and 2 committed.
    pub first_poll: Vec<i64>,
    /// Whether the first poll stopped at the gap 1 left.
    pub first_poll_waiting_on_gap: bool,
    /// After 1 committed.
    pub second_poll: Vec<i64>,
    /// While 3 is in flight and 4 committed.
    pub third_poll: Vec<i64>,
    /// Once 3 rolled back.
    pub after_rollback: Vec<i64>,
    pub(crate) timeline: Vec<Step>,
}

impl CatchUp {
    pub(crate) fn invariant_held(&self) -> bool {
        self.first_poll.is_empty()
            && self.first_poll_waiting_on_gap
            && self.second_poll == [1, 2]
            && self.third_poll.is_empty()
            && self.after_rollback == [4]
    }
}

/// Everything `pgonce race events` replays.
#[derive(Debug, Clone)]
pub struct EventsRace {
    /// The three writers, under each append strategy.
    pub three_writers: Vec<ThreeWriters>,
    /// The late decision, under each append strategy.
    pub late_decisions: Vec<LateDecision>,
    /// The catch-up reader facing its gaps.
    pub catch_up: CatchUp,
}

pub(crate) async fn run(db: &RunDatabase) -> anyhow::Result<Report> {
    let race = replay(db).await?;
    Ok(report(&race, db.environment().await?))
}

/// Replays every case on `db`: what each showed, for the report or a
/// test.
pub async fn replay(db: &RunDatabase) -> anyhow::Result<EventsRace> {
    let mut three = Vec::new();
    for strategy in AppendStrategy::ALL {
        three.push(three_writers(db, strategy).await?);
    }
    let mut late_decisions = Vec::new();
    for strategy in AppendStrategy::ALL {
        late_decisions.push(late_lower_position_decision(db, strategy).await?);
    }
    Ok(EventsRace {
        three_writers: three,
        late_decisions,
        catch_up: late_lower_position_catch_up(db).await?,
    })
}

pub(crate) fn report(race: &EventsRace, environment: Environment) -> Report {
    let mut report = Report::new("race", "events", environment);
    for case in &race.three_writers {
        let name = case.strategy.name();
        let failed: Vec<&str> = [("B", &case.b), ("C", &case.c)]
            .into_iter()
            .filter(|(_, o)| !o.committed())
            .map(|(s, _)| s)
            .collect();
        let retried = |o: &Option<AppendOutcome>| match o {
            Some(r) => format!(", retried: {}", r.describe()),
            None => String::new(),
        };
        report.results.push(
            Row::new(name)
                .with("case", "three writers: A 123, B 456, C 123")
                .with("parallel", case.parallel.join(", "))
                .with(
                    "waited",
                    or_nobody(
                        case.waits
                            .iter()
                            .map(|w| format!("{} on {}", w.session, w.blocked_by.join(", "))),
                    ),
                )
                .with("failed", or_nobody(failed.iter().map(|s| s.to_string())))
                .with("a", "committed")
                .with(
                    "b",
                    format!("{}{}", case.b.describe(), retried(&case.b_retry)),
                )
                .with(
                    "c",
                    format!("{}{}", case.c.describe(), retried(&case.c_retry)),
                )
                .with("final_log", show_log(&case.log))
                .with("invariant_held", case.invariant_held()),
        );
        report.sections.insert(
            format!("timeline: {name}"),
            timeline_rows(name, &case.timeline),
        );
        report.verdict.check(
            case.invariant_held(),
            format!("{name}: one booking per tag; C's conflicting append failed"),
        );
    }
    for case in &race.late_decisions {
        let name = case.strategy.name();
        report.results.push(
            Row::new(name)
                .with("case", "out-of-order: decision while position 1 in flight")
                .with(
                    "w2",
                    if case.w2_appended {
                        "appended position 2 and committed"
                    } else {
                        "skipped: the table lock makes W2 wait for W1"
                    },
                )
                .with("waited", format!("R on {}", case.r_waited_for.join(", ")))
                .with(
                    "decision_saw",
                    format!("{:?}, after {:?}", case.decision_saw, case.decision_after),
                )
                .with("invariant_held", case.invariant_held()),
        );
        report.sections.insert(
            format!("timeline: out-of-order decision, {name}"),
            timeline_rows(name, &case.timeline),
        );
        report.verdict.check(
            case.invariant_held(),
            format!("{name}: the decision read waited for the in-flight lower position and saw it"),
        );
    }
    let c = &race.catch_up;
    report.results.push(
        Row::new("catch-up")
            .with("case", "out-of-order: 2 commits before 1")
            .with("first_poll", format!("{:?} (gap at 1)", c.first_poll))
            .with("second_poll", format!("{:?}", c.second_poll))
            .with(
                "after_rollback",
                format!("{:?} then {:?}", c.third_poll, c.after_rollback),
            )
            .with("invariant_held", c.invariant_held()),
    );
    report.sections.insert(
        "timeline: out-of-order catch-up".into(),
        timeline_rows("catch-up", &c.timeline),
    );
    report.verdict.check(
        c.invariant_held(),
        "catch-up delivered 1 then 2 after 1 committed late, and skipped nothing",
    );
    report
}

fn or_nobody(items: impl Iterator<Item = String>) -> String {
    let items: Vec<String> = items.collect();
    if items.is_empty() {
        "nobody".into()
    } else {
        items.join("; ")
    }
}

pub(crate) fn store(session: &Session, strategy: AppendStrategy) -> anyhow::Result<EventStore> {
    Ok(EventStore::new(
        session.pool().clone(),
        EventStoreConfig {
            strategy,
            ..Default::default()
        },
    )?)
}

fn booking(tag: &str) -> Vec<Event> {
    vec![
        Event::new("BookingPlaced")
            .tag(tag)
            .data(json!({ "booking": tag })),
    ]
}

pub(crate) fn on(tag: &str) -> anyhow::Result<Query> {
    Ok(Query::item(Vec::<String>::new(), [tag])?)
}

fn condition(tag: &str, d: &Decision) -> anyhow::Result<AppendCondition> {
    Ok(AppendCondition::new(on(tag)?, d.after))
}

pub(crate) async fn clean(db: &RunDatabase) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE pgonce.events RESTART IDENTITY")
        .execute(db.pool())
        .await?;
    Ok(())
}

/// A clean log and a harness with three sessions, each with its store.
pub(crate) async fn three_sessions(
    db: &RunDatabase,
    strategy: AppendStrategy,
    names: [&str; 3],
) -> anyhow::Result<(Interleaving, [(Session, EventStore); 3])> {
    clean(db).await?;
    let race = Interleaving::new(db.options()).await?;
    let mut sessions = Vec::new();
    for name in names {
        let session = race.session(name).await?;
        let store = store(&session, strategy)?;
        sessions.push((session, store));
    }
    let sessions = sessions
        .try_into()
        .map_err(|_| anyhow::anyhow!("three sessions"))?;
    Ok((race, sessions))
}

async fn three_writers(db: &RunDatabase, strategy: AppendStrategy) -> anyhow::Result<ThreeWriters> {
    let (race, [(a, sa), (b, sb), (c, sc)]) = three_sessions(db, strategy, ["A", "B", "C"]).await?;
    let (q123, q456) = (on("booking:123")?, on("booking:456")?);
    let d_a = race
        .try_step(&a, "decide on booking:123", sa.decide(&q123))
        .await?;
    let d_b = race
        .try_step(&b, "decide on booking:456", sb.decide(&q456))
        .await?;
    let d_c = race
        .try_step(&c, "decide on booking:123", sc.decide(&q123))
        .await?;
    let (c_a, c_b, c_c) = (
        condition("booking:123", &d_a)?,
        condition("booking:456", &d_b)?,
        condition("booking:123", &d_c)?,
    );
    let pending_a = race
        .try_step(
            &a,
            "check + insert booking:123",
            sa.begin_append(&booking("booking:123"), Some(&c_a)),
        )
        .await?;
    let mut parallel = vec!["A".to_string()];
    let mut waits = Vec::new();
    let (b_result, c_result): (Result<Vec<i64>, Error>, Result<Vec<i64>, Error>);
    match strategy {
        AppendStrategy::AdvisoryLocks => {
            let pending_b = race
                .try_step(
                    &b,
                    "check + insert booking:456",
                    sb.begin_append(&booking("booking:456"), Some(&c_b)),
                )
                .await?;
            parallel.push("B".into());
            let (sc, cc) = (sc.clone(), c_c.clone());
            let c_blocked = race
                .step_blocks(&c, "lock booking:123 + check + insert", async move {
                    sc.append(&booking("booking:123"), Some(&cc))
                        .await
                        .map(|a| a.positions)
                })
                .await?;
            waits.push(Wait {
                session: "C".into(),
                blocked_by: c_blocked.blocked_by().to_vec(),
            });
            race.try_step(&a, "COMMIT", pending_a.commit()).await?;
            b_result = race.step(&b, "COMMIT", pending_b.commit()).await?;
            c_result = c_blocked.resume().await?;
        }
        AppendStrategy::Serializable => {
            let pending_b = race
                .try_step(
                    &b,
                    "check + insert booking:456",
                    sb.begin_append(&booking("booking:456"), Some(&c_b)),
                )
                .await?;
            let pending_c = race
                .try_step(
                    &c,
                    "check + insert booking:123",
                    sc.begin_append(&booking("booking:123"), Some(&c_c)),
                )
                .await?;
            parallel.extend(["B".into(), "C".into()]);
            race.try_step(&a, "COMMIT", pending_a.commit()).await?;
            b_result = race.step(&b, "COMMIT", pending_b.commit()).await?;
            c_result = race.step(&c, "COMMIT", pending_c.commit()).await?;
        }
        AppendStrategy::TableLock => {
            let (sb2, cb) = (sb.clone(), c_b.clone());
            let b_blocked = race
                .step_blocks(&b, "LOCK TABLE + check + insert booking:456", async move {
                    sb2.append(&booking("booking:456"), Some(&cb)).await
                })
                .await?;
            waits.push(Wait {
                session: "B".into(),
                blocked_by: b_blocked.blocked_by().to_vec(),
            });
            let (sc, cc) = (sc.clone(), c_c.clone());
            let c_blocked = race
                .step_blocks(&c, "LOCK TABLE + check + insert booking:123", async move {
                    sc.append(&booking("booking:123"), Some(&cc)).await
                })
                .await?;
            waits.push(Wait {
                session: "C".into(),
                blocked_by: c_blocked.blocked_by().to_vec(),
            });
            race.try_step(&a, "COMMIT", pending_a.commit()).await?;
            b_result = b_blocked.resume().await?.map(|a| a.positions);
            c_result = c_blocked.resume().await?.map(|a| a.positions);
        }
    }
    let (b_first, c_first) = (AppendOutcome::of(b_result), AppendOutcome::of(c_result));
    // What the strategy's retry does with a serialization failure.
    let mut b_retry = None;
    if b_first.is_serialization_failure() {
        let r = AppendOutcome::of(
            sb.append(&booking("booking:456"), Some(&c_b))
                .await
                .map(|a| a.positions),
        );
        race.note(&b, &format!("retry: {}", r.describe()));
        b_retry = Some(r);
    }
    let mut c_retry = None;
    if c_first.is_serialization_failure() {
        let r = AppendOutcome::of(
            sc.append(&booking("booking:123"), Some(&c_c))
                .await
                .map(|a| a.positions),
        );
        race.note(&c, &format!("retry: {}", r.describe()));
        c_retry = Some(r);
    }
    Ok(ThreeWriters {
        strategy,
        parallel,
        waits,
        b: b_first,
        c: c_first,
        b_retry,
        c_retry,
        log: read_log(db).await?,
        timeline: race.timeline(),
    })
}

/// W1 inserts booking:9 at position 1 and stays open; W2 appends position 2
/// and commits; R's decision read on booking:9 must wait for W1 and see it.
async fn late_lower_position_decision(
    db: &RunDatabase,
    strategy: AppendStrategy,
) -> anyhow::Result<LateDecision> {
    let (race, [(w1, s1), (w2, s2), (r, sr)]) =
        three_sessions(db, strategy, ["W1", "W2", "R"]).await?;
    let q9 = on("booking:9")?;
    let p1 = race
        .try_step(
            &w1,
            "insert booking:9 (position 1), no COMMIT yet",
            s1.begin_append(&booking("booking:9"), None),
        )
        .await?;
    let w2_appended = strategy != AppendStrategy::TableLock;
    if w2_appended {
        race.try_step(
            &w2,
            "append other (position 2), COMMIT",
            s2.append(&booking("other"), None),
        )
        .await?;
    }
    // The hazard a plain read has: position 1 is not visible yet.
    let plain_read_saw: Vec<i64> = sr
        .read(&q9, ReadOptions::default())
        .await?
        .iter()
        .map(|e| e.position)
        .collect();
    let (sr2, q) = (sr.clone(), q9.clone());
    let waiting = race
        .step_blocks(
            &r,
            "decide on booking:9",
            async move { sr2.decide(&q).await },
        )
        .await?;
    let r_waited_for = waiting.blocked_by().to_vec();
    race.try_step(&w1, "COMMIT", p1.commit()).await?;
    let decision = waiting.try_resume().await?;
    let stale = AppendOutcome::of(
        sr.append(
            &booking("booking:9"),
            Some(&AppendCondition::new(q9.clone(), Some(0))),
        )
        .await
        .map(|a| a.positions),
    );
    race.note(
        &r,
        &format!("a stale condition (after 0): {}", stale.describe()),
    );
    let fresh = AppendOutcome::of(
        sr.append(
            &booking("booking:9"),
            Some(&AppendCondition::new(q9, decision.after)),
        )
        .await
        .map(|a| a.positions),
    );
    race.note(
        &r,
        &format!(
            "the decision's condition (after {:?}): {}",
            decision.after,
            fresh.describe()
        ),
    );
    Ok(LateDecision {
        strategy,
        w2_appended,
        plain_read_saw,
        r_waited_for,
        decision_saw: decision.events.iter().map(|e| e.position).collect(),
        decision_after: decision.after,
        stale,
        fresh,
        timeline: race.timeline(),
    })
}

/// Position 2 commits while 1 is in flight: the catch-up reader delivers
/// nothing, then 1 and 2 in order once 1 commits. A rolled-back position
/// (3) stops it only until its transaction has ended.
async fn late_lower_position_catch_up(db: &RunDatabase) -> anyhow::Result<CatchUp> {
    let (race, [(w1, s1), (w2, s2), (r, sr)]) =
        three_sessions(db, AppendStrategy::AdvisoryLocks, ["W1", "W2", "R"]).await?;
    let mut sub = sr
        .subscribe(SubscriptionConfig {
            listen: pgonce::Listen::Off,
            ..Default::default()
        })
        .await?;
    let positions = |events: &[pgonce::events::StoredEvent]| -> Vec<i64> {
        events.iter().map(|e| e.position).collect()
    };
    let p1 = race
        .try_step(
            &w1,
            "insert position 1, no COMMIT yet",
            s1.begin_append(&booking("a"), None),
        )
        .await?;
    race.try_step(
        &w2,
        "append position 2, COMMIT",
        s2.append(&booking("b"), None),
    )
    .await?;
    let first = race.try_step(&r, "catch-up poll", sub.run_once()).await?;
    let c1 = first.counters;
    let first = positions(&first.events);
    race.note(
        &r,
        &format!("delivered {first:?}, waiting on gap: {}", c1.waiting_on_gap),
    );
    race.try_step(&w1, "COMMIT", p1.commit()).await?;
    let second = race.try_step(&r, "catch-up poll", sub.run_once()).await?;
    let second = positions(&second.events);
    race.note(&r, &format!("delivered {second:?}"));

    let p3 = race
        .try_step(
            &w1,
            "insert position 3, no COMMIT yet",
            s1.begin_append(&booking("c"), None),
        )
        .await?;
    race.try_step(
        &w2,
        "append position 4, COMMIT",
        s2.append(&booking("d"), None),
    )
    .await?;
    let third = race.try_step(&r, "catch-up poll", sub.run_once()).await?;
    let third = positions(&third.events);
    race.note(&r, &format!("delivered {third:?}"));
    race.try_step(&w1, "ROLLBACK", p3.rollback()).await?;
    // Once every transaction that was running when the gap was seen has
    // ended; other databases share the server, so that may take a few
    // polls: a state polled for, like the harness's blocked sessions.
    let settled = race
        .try_step(&r, "catch-up poll until the gap settles", async {
            loop {
                let polled = sub.run_once().await?;
                if !polled.counters.waiting_on_gap || !polled.events.is_empty() {
                    return Ok::<_, Error>(polled.events);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await?;
    let after_rollback = positions(&settled);
    race.note(&r, &format!("delivered {after_rollback:?}"));
    Ok(CatchUp {
        first_poll: first,
        first_poll_waiting_on_gap: c1.waiting_on_gap,
        second_poll: second,
        third_poll: third,
        after_rollback,
        timeline: race.timeline(),
    })
}
