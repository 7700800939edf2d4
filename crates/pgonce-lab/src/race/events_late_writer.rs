//! `pgonce race events-late-writer`: a writer without a condition holds a
//! lower position open while a conditional writer that decided before it
//! checks, under each append strategy.
//!
//! Position 1 holds a committed `course:1` event. C decides on `course:1`
//! (`after` = 1) and will append under "no `course:1` event after 1". A
//! appends a `course:1` event at position 2 with no condition and does not
//! commit yet; B commits position 3 (another course). C checks its
//! condition and appends (under the table lock and the advisory locks it
//! waits for A); A commits; then C commits, or not.
//!
//! C must not commit while A's lower event matches its condition: C fails
//! its condition, or one of the two gets a serialization failure. A
//! committed C with a matching event between its `after` and its own
//! position is a violation, reported as such. A does it twice: through
//! `begin_append`, and through `append_in` inside a caller's SERIALIZABLE
//! transaction.

use pgonce::IsolationLevel;
use pgonce::events::{AppendCondition, AppendStrategy, Event, PendingAppend};
use pgonce_testkit::Step;
use serde_json::json;
use sqlx::{Postgres, Transaction};

use super::events::{AppendOutcome, LoggedEvent, on, read_log, show_log, three_sessions};
use super::{maybe_blocks, timeline_rows};
use crate::report::{Environment, Report, Row};
use crate::scratch::RunDatabase;

/// The course every writer but B is about.
const COURSE: &str = "course:1";

/// How A appends its `course:1` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LateWriter {
    /// `EventStore::begin_append` with no condition, committed later.
    BeginAppend,
    /// `EventStore::append_in` inside the caller's SERIALIZABLE
    /// transaction, committed later by the caller.
    AppendInSerializable,
}

impl LateWriter {
    /// Both kinds, in the order the race replays them.
    pub const ALL: [LateWriter; 2] = [LateWriter::BeginAppend, LateWriter::AppendInSerializable];

    pub(crate) fn name(self) -> &'static str {
        match self {
            LateWriter::BeginAppend => "begin_append",
            LateWriter::AppendInSerializable => "append_in (SERIALIZABLE)",
        }
    }
}

/// One strategy's replay with one kind of late writer.
#[derive(Debug, Clone)]
pub struct LateWriterCase {
    pub(crate) strategy: AppendStrategy,
    pub(crate) writer: LateWriter,
    /// C's decision: every `course:1` event at or below it was seen.
    pub after: Option<i64>,
    /// The position A drew, before it committed.
    pub a_drew: Vec<i64>,
    /// A's COMMIT.
    pub a: AppendOutcome,
    /// B's append on another course, committed while A's is open.
    pub b: AppendOutcome,
    pub(crate) b_waited_for: Vec<String>,
    /// Whom C's check waited for; empty when it did not wait.
    pub c_waited_for: Vec<String>,
    /// C's check and COMMIT.
    pub c: AppendOutcome,
    /// The append's own retry after a serialization failure of C's.
    pub(crate) c_retry: Option<AppendOutcome>,
    /// The event log at the end, by position.
    pub log: Vec<LoggedEvent>,
    pub(crate) timeline: Vec<Step>,
}

impl LateWriterCase {
    /// The `course:1` events in the log between C's `after` and a position
    /// C committed: each one C's condition should have refused.
    pub fn violations(&self) -> Vec<i64> {
        let after = self.after.unwrap_or(0);
        let c_positions: Vec<i64> = self
            .c
            .positions()
            .iter()
            .chain(self.c_retry.iter().flat_map(|r| r.positions()))
            .copied()
            .collect();
        let Some(&c_first) = c_positions.iter().min() else {
            return Vec::new();
        };
        self.log
            .iter()
            .filter(|e| {
                e.position > after
                    && e.position < c_first
                    && !c_positions.contains(&e.position)
                    && e.tags.iter().any(|t| t == COURSE)
            })
            .map(|e| e.position)
            .collect()
    }

    pub(crate) fn invariant_held(&self) -> bool {
        self.violations().is_empty()
    }

    /// Whether the strategy makes C's check wait for A's open append.
    pub(crate) fn c_must_wait(&self) -> bool {
        self.strategy != AppendStrategy::Serializable
    }
}

/// Everything `pgonce race events-late-writer` replays.
#[derive(Debug, Clone)]
pub(crate) struct LateWriterRace {
    pub(crate) cases: Vec<LateWriterCase>,
}

pub(crate) async fn run(db: &RunDatabase) -> anyhow::Result<Report> {
    let race = replay(db).await?;
    Ok(report(&race, db.environment().await?))
}

pub(crate) async fn replay(db: &RunDatabase) -> anyhow::Result<LateWriterRace> {
    let mut cases = Vec::new();
    for writer in LateWriter::ALL {
        for strategy in AppendStrategy::ALL {
            cases.push(replay_case(db, strategy, writer).await?);
        }
    }
    Ok(LateWriterRace { cases })
}

pub(crate) fn report(race: &LateWriterRace, environment: Environment) -> Report {
    let mut report = Report::new("race", "events-late-writer", environment);
    for case in &race.cases {
        let name = case.strategy.name();
        let violations = case.violations();
        report.results.push(
            Row::new(name)
                .with("case", format!("A appends through {}", case.writer.name()))
                .with(
                    "a",
                    format!("drew {:?}, {}", case.a_drew, case.a.describe()),
                )
                .with("b", case.b.describe())
                .with("b_waited", waited(&case.b_waited_for))
                .with("c_waited", waited(&case.c_waited_for))
                .with(
                    "c",
                    match &case.c_retry {
                        Some(r) => format!("{}, retried: {}", case.c.describe(), r.describe()),
                        None => case.c.describe(),
                    },
                )
                .with("final_log", show_log(&case.log))
                .with("violations", violations.len())
                .with("invariant_held", case.invariant_held()),
        );
        report.sections.insert(
            format!("timeline: {name}, {}", case.writer.name()),
            timeline_rows(name, &case.timeline),
        );
        let waited_ok = !case.c_must_wait() || case.c_waited_for.iter().any(|s| s == "A");
        report.verdict.check(
            case.invariant_held() && waited_ok,
            if case.invariant_held() {
                format!(
                    "{name}, A through {}: C did not commit over A's lower {COURSE} event{}",
                    case.writer.name(),
                    if case.c_must_wait() {
                        format!("; C waited for {}", case.c_waited_for.join(", "))
                    } else {
                        String::new()
                    }
                )
            } else {
                format!(
                    "{name}, A through {}: C committed although A's {COURSE} event at {violations:?} is after C's after {:?}",
                    case.writer.name(),
                    case.after
                )
            },
        );
    }
    report
}

fn waited(by: &[String]) -> String {
    if by.is_empty() {
        "no wait".into()
    } else {
        format!("waited for {}", by.join(", "))
    }
}

fn enrolled(course: &str) -> Vec<Event> {
    vec![
        Event::new("StudentEnrolled")
            .tag(course)
            .data(json!({ "course": course })),
    ]
}

/// A's append, open until [`OpenAppend::commit`].
enum OpenAppend {
    Pending(PendingAppend),
    Caller(Transaction<'static, Postgres>, Vec<i64>),
}

impl OpenAppend {
    async fn commit(self) -> Result<Vec<i64>, pgonce::Error> {
        match self {
            OpenAppend::Pending(p) => p.commit().await,
            OpenAppend::Caller(tx, positions) => {
                tx.commit().await?;
                Ok(positions)
            }
        }
    }

    fn positions(&self) -> &[i64] {
        match self {
            OpenAppend::Pending(p) => p.positions(),
            OpenAppend::Caller(_, positions) => positions,
        }
    }
}

/// The schedule of the module docs, under `strategy`, A appending as
/// `writer` says.
pub async fn replay_case(
    db: &RunDatabase,
    strategy: AppendStrategy,
    writer: LateWriter,
) -> anyhow::Result<LateWriterCase> {
    let (race, [(a, sa), (b, sb), (c, sc)]) = three_sessions(db, strategy, ["A", "B", "C"]).await?;
    race.try_step(
        &a,
        "append course:1 (position 1), COMMIT",
        sa.append(&enrolled(COURSE), None),
    )
    .await?;
    let decision = race
        .try_step(&c, "decide on course:1", sc.decide(&on(COURSE)?))
        .await?;
    let condition = AppendCondition::new(on(COURSE)?, decision.after);

    let open_a = match writer {
        LateWriter::BeginAppend => OpenAppend::Pending(
            race.try_step(
                &a,
                "insert course:1, no condition, no COMMIT yet",
                sa.begin_append(&enrolled(COURSE), None),
            )
            .await?,
        ),
        LateWriter::AppendInSerializable => {
            let mut tx = race
                .try_step(
                    &a,
                    "BEGIN ISOLATION LEVEL SERIALIZABLE",
                    pgonce::begin(a.pool(), IsolationLevel::Serializable),
                )
                .await?;
            let positions = race
                .try_step(
                    &a,
                    "append_in: insert course:1, no COMMIT yet",
                    sa.append_in(&mut tx, &enrolled(COURSE)),
                )
                .await?;
            OpenAppend::Caller(tx, positions)
        }
    };
    let a_drew = open_a.positions().to_vec();

    let sb2 = sb.clone();
    let b_step = maybe_blocks(&race, &b, "append course:2, COMMIT", async move {
        sb2.append(&enrolled("course:2"), None)
            .await
            .map(|a| a.positions)
    })
    .await?;
    let b_waited_for = b_step.waited_for.clone();
    // B's append is done unless it waits for A (the table lock).
    let b_pending = if b_waited_for.is_empty() {
        let out = AppendOutcome::of(b_step.finish().await?);
        race.note(&b, &format!("B: {}", out.describe()));
        Err(out)
    } else {
        Ok(b_step)
    };

    let (sc2, cond) = (sc.clone(), condition.clone());
    let c_step = maybe_blocks(
        &race,
        &c,
        "check 'no course:1 after 1' + insert",
        async move { sc2.begin_append(&enrolled(COURSE), Some(&cond)).await },
    )
    .await?;
    let c_waited_for = c_step.waited_for.clone();

    let a_out = AppendOutcome::of(race.step(&a, "COMMIT", open_a.commit()).await?);
    race.note(&a, &format!("A: {}", a_out.describe()));
    let b = match b_pending {
        Err(out) => out,
        Ok(step) => {
            let out = AppendOutcome::of(step.finish().await?);
            race.note(&b, &format!("B: {}", out.describe()));
            out
        }
    };
    let c_out = match c_step.finish().await? {
        Ok(pending) => AppendOutcome::of(race.step(&c, "COMMIT", pending.commit()).await?),
        Err(e) => AppendOutcome::of(Err(e)),
    };
    race.note(&c, &format!("C: {}", c_out.describe()));
    let mut c_retry = None;
    if c_out.is_serialization_failure() {
        let r = AppendOutcome::of(
            sc.append(&enrolled(COURSE), Some(&condition))
                .await
                .map(|a| a.positions),
        );
        race.note(&c, &format!("retry: {}", r.describe()));
        c_retry = Some(r);
    }
    Ok(LateWriterCase {
        strategy,
        writer,
        after: decision.after,
        a_drew,
        a: a_out,
        b,
        b_waited_for,
        c_waited_for,
        c: c_out,
        c_retry,
        log: read_log(db).await?,
        timeline: race.timeline(),
    })
}
