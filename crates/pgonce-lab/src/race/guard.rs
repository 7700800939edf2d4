//! `pgonce race guard`: the duplicate-incident race (steps T00-T10) replayed
//! with the harness. Two workers get the same message for one entity (the
//! second by redelivery), both read "no open incident", both evaluate, both
//! try to create one, under each strategy. The table shows, from the database,
//! how many incidents are open at the end: two for the unsafe strategies, one
//! for the safe ones, and for each whether a connection was held while
//! evaluating. The rows and statements are [`crate::scenario::guard`]'s;
//! this file decides which worker runs which of them when.

use std::time::Duration;

use pgonce::{Error, Guard, GuardConfig, IsolationLevel, ReadSet};
use pgonce_testkit::{HarnessError, Interleaving, Session, Step};
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};

use super::timeline_rows;
use crate::report::{Environment, Report, Row};
use crate::scenario::guard::{
    self as scenario, Decision, Entity, GuardStrategy as Strategy, Written,
};
use crate::scratch::RunDatabase;

/// The strategies raced, in the report's order.
pub const RACED: [Strategy; 6] = [
    Strategy::TwoTransactions,
    Strategy::RepeatableRead,
    Strategy::Serializable,
    Strategy::SessionLock,
    Strategy::UniqueIndex,
    Strategy::Guard,
];

/// What the workers' code counted during one strategy's run.
#[derive(Debug, Default)]
struct Counts {
    conflicts: u64,
    aborts: u64,
    retries: u64,
    held_during_evaluation: bool,
}

/// What one strategy's run left behind.
#[derive(Debug, Clone)]
pub struct GuardCase {
    /// The strategy both workers used.
    pub strategy: Strategy,
    /// Open incidents of the entity at the end, read from the database.
    pub open_incidents: i64,
    /// Writes refused because another worker won (a guard conflict, a
    /// unique violation).
    pub conflicts: u64,
    /// Serialization failures, and the retries they cost.
    pub(crate) aborts: u64,
    pub(crate) retries: u64,
    /// Whether a worker held its connection while evaluating.
    pub held_during_evaluation: bool,
    pub(crate) timeline: Vec<Step>,
}

impl GuardCase {
    /// At most one open incident per entity.
    pub(crate) fn invariant_held(&self) -> bool {
        self.open_incidents <= 1
    }
}

/// Everything `pgonce race guard` replays.
#[derive(Debug, Clone)]
pub struct GuardRace {
    /// One case per strategy of [`RACED`].
    pub cases: Vec<GuardCase>,
}

struct Ctx {
    race: Interleaving,
    w1: Session,
    w2: Session,
    entity: Entity,
}

/// The op each worker's incident is tagged with.
fn op_of(w: &Session) -> i64 {
    if w.name() == "W1" { 1 } else { 2 }
}

pub(crate) async fn run(db: &RunDatabase) -> anyhow::Result<Report> {
    let race = replay(db).await?;
    Ok(report(&race, db.environment().await?))
}

/// Replays the duplicate-incident race on `db` under each strategy of
/// [`RACED`].
pub async fn replay(db: &RunDatabase) -> anyhow::Result<GuardRace> {
    scenario::create_schema(db.pool()).await?;
    let mut cases = Vec::new();
    for strategy in RACED {
        // Each strategy its own scope, so earlier strategies' duplicates
        // stay as evidence.
        let entity = Entity::new(format!("race-guard/{}", strategy.name()), "entity-1");
        let race = Interleaving::new(db.options()).await?;
        let ctx = Ctx {
            w1: race.session("W1").await?,
            w2: race.session("W2").await?,
            race,
            entity,
        };
        if strategy == Strategy::UniqueIndex {
            // The index covers this strategy's own scope only.
            sqlx::query(include_str!("sql/guard_unique_index.sql"))
                .execute(db.pool())
                .await?;
        }
        let outcome = match strategy {
            Strategy::TwoTransactions => two_transactions(&ctx, false).await?,
            Strategy::RepeatableRead => {
                one_transaction(&ctx, IsolationLevel::RepeatableRead).await?
            }
            Strategy::Serializable => one_transaction(&ctx, IsolationLevel::Serializable).await?,
            Strategy::SessionLock => session_lock(&ctx).await?,
            Strategy::UniqueIndex => two_transactions(&ctx, true).await?,
            Strategy::Guard => guard(&ctx).await?,
            Strategy::GuardBeginCheck => {
                anyhow::bail!("{} is measured by the bench, not raced", strategy.name())
            }
        };
        if strategy == Strategy::UniqueIndex {
            sqlx::query(include_str!("sql/guard_drop_unique_index.sql"))
                .execute(db.pool())
                .await?;
        }
        cases.push(GuardCase {
            strategy,
            open_incidents: count_open(db.pool(), &ctx.entity).await?,
            conflicts: outcome.conflicts,
            aborts: outcome.aborts,
            retries: outcome.retries,
            held_during_evaluation: outcome.held_during_evaluation,
            timeline: ctx.race.timeline(),
        });
    }
    Ok(GuardRace { cases })
}

pub(crate) fn report(race: &GuardRace, environment: Environment) -> Report {
    let mut report = Report::new("race", "guard", environment);
    for case in &race.cases {
        let (strategy, open, outcome) = (case.strategy, case.open_incidents, case);
        report.results.push(
            Row::new(strategy.name())
                .with("open_incidents", open)
                .with("conflicts", outcome.conflicts)
                .with("aborts", outcome.aborts)
                .with("retries", outcome.retries)
                .with(
                    "connection_held_during_evaluation",
                    outcome.held_during_evaluation,
                )
                .with("invariant_held", case.invariant_held()),
        );
        report.sections.insert(
            format!("timeline: {}", strategy.name()),
            timeline_rows(strategy.name(), &case.timeline),
        );
        if strategy == Strategy::Guard {
            report.verdict.check(
                open == 1 && outcome.conflicts == 1 && !outcome.held_during_evaluation,
                format!(
                    "guard: {open} open incident(s), {} conflict(s), no connection held while evaluating: I1 kept",
                    outcome.conflicts
                ),
            );
        } else if strategy.safe() {
            report.verdict.check(
                open == 1,
                format!("{}: {open} open incident(s), as expected", strategy.name()),
            );
        } else {
            report.verdict.check(
                open == 2,
                format!(
                    "{}: {open} open incidents, the duplicate shown",
                    strategy.name()
                ),
            );
        }
    }
    report.sections.insert(
        "notes".into(),
        vec![
            Row::new("unique-index").with(
                "note",
                "holds here only because this race's rule is static; it cannot express \
                 a policy that is a singleton for some entities, decided at run time",
            ),
            Row::new("serializable").with(
                "note",
                "keeps I1 by aborting W2; the application owes the retry, and every other \
                 transaction on these tables must be ready to retry too",
            ),
            Row::new("session-lock").with(
                "note",
                "keeps I1 by holding a pooled connection through the evaluation: in-flight \
                 work is capped by the pool size",
            ),
        ],
    );
    report
}

async fn count_open(pool: &PgPool, entity: &Entity) -> pgonce::Result<i64> {
    let open = scenario::read_open(&mut *pool.acquire().await?, entity).await?;
    Ok(open.len() as i64)
}

/// Whether the worker's code holds its session's only connection right now
/// (the pool cannot hand it out).
async fn holds_connection(session: &Session) -> bool {
    tokio::time::timeout(Duration::from_millis(300), session.pool().acquire())
        .await
        .is_err()
}

async fn evaluate(ctx: &Ctx, w: &Session, at: &str, outcome: &mut Counts) -> anyhow::Result<()> {
    let held = holds_connection(w).await;
    outcome.held_during_evaluation |= held;
    ctx.race.note(
        w,
        &format!(
            "{at} evaluation (remote calls){}",
            if held {
                ", connection held"
            } else {
                ", no connection held"
            }
        ),
    );
    Ok(())
}

/// The naive code: read in one transaction, write in another. With
/// `unique_index`, a partial unique index (one OPEN incident per entity of
/// the scope) turns W2's insert into a unique violation, counted as a
/// conflict.
async fn two_transactions(ctx: &Ctx, unique_index: bool) -> anyhow::Result<Counts> {
    let mut outcome = Counts::default();
    let read = async |w: &Session| -> pgonce::Result<ReadSet> {
        let mut tx = pgonce::begin_read_only(w.pool(), IsolationLevel::ReadCommitted).await?;
        let seen = scenario::read_open(&mut tx, &ctx.entity).await?;
        tx.commit().await?;
        Ok(seen)
    };
    let seen1 = ctx
        .race
        .try_step(&ctx.w1, "T01 read open incidents", read(&ctx.w1))
        .await?;
    evaluate(ctx, &ctx.w1, "T02", &mut outcome).await?;
    let seen2 = ctx
        .race
        .try_step(&ctx.w2, "T05 read open incidents", read(&ctx.w2))
        .await?;
    evaluate(ctx, &ctx.w2, "T06", &mut outcome).await?;
    for (w, seen, at) in [(&ctx.w1, &seen1, "T08"), (&ctx.w2, &seen2, "T10")] {
        let Some(decision) = Decision::open_if_none(seen) else {
            continue;
        };
        let written = ctx
            .race
            .try_step(
                w,
                &format!("{at} insert incident, COMMIT"),
                scenario::write_plain(w.pool(), &ctx.entity, decision, op_of(w)),
            )
            .await?;
        if let Written::Refused(e) = written {
            anyhow::ensure!(unique_index, "refused with no unique index: {e}");
            outcome.conflicts += 1;
            ctx.race.note(w, "unique violation: another worker won");
        }
    }
    Ok(outcome)
}

/// Read, evaluate and write in one transaction at `level`; under
/// SERIALIZABLE, an aborted worker retries the whole transaction once.
async fn one_transaction(ctx: &Ctx, level: IsolationLevel) -> anyhow::Result<Counts> {
    let begin = &format!("BEGIN ISOLATION LEVEL {level}");
    let mut outcome = Counts::default();
    let (race, entity) = (&ctx.race, &ctx.entity);
    let mut tx1 = race
        .try_step(&ctx.w1, begin, pgonce::begin(ctx.w1.pool(), level))
        .await?;
    let seen1 = race
        .try_step(
            &ctx.w1,
            "T01 read open incidents",
            scenario::read_open(&mut tx1, entity),
        )
        .await?;
    evaluate(ctx, &ctx.w1, "T02", &mut outcome).await?;
    let mut tx2 = race
        .try_step(&ctx.w2, begin, pgonce::begin(ctx.w2.pool(), level))
        .await?;
    let seen2 = race
        .try_step(
            &ctx.w2,
            "T05 read open incidents",
            scenario::read_open(&mut tx2, entity),
        )
        .await?;
    evaluate(ctx, &ctx.w2, "T06", &mut outcome).await?;
    if let Some(decision) = Decision::open_if_none(&seen1) {
        race.try_step(
            &ctx.w1,
            "T08 insert incident",
            scenario::apply(&mut tx1, entity, decision, 1),
        )
        .await?;
    }
    race.try_step(&ctx.w1, "T08 COMMIT", tx1.commit()).await?;
    let mut w2_result: pgonce::Result<()> = Ok(());
    if let Some(decision) = Decision::open_if_none(&seen2) {
        w2_result = race
            .step(
                &ctx.w2,
                "T10 insert incident",
                scenario::apply(&mut tx2, entity, decision, 2),
            )
            .await?
            .map(|_| ());
    }
    if w2_result.is_ok() {
        w2_result = race
            .step(&ctx.w2, "T10 COMMIT", tx2.commit())
            .await?
            .map_err(Error::from);
    } else {
        drop(tx2);
    }
    match w2_result {
        Ok(()) => {}
        Err(e) => {
            if !(level == IsolationLevel::Serializable && e.is_retryable()) {
                return Err(e.into());
            }
            outcome.aborts += 1;
            race.note(&ctx.w2, "serialization failure: W2 aborted; retrying");
            // The retry the application owes: the whole transaction again,
            // evaluation included.
            outcome.retries += 1;
            let mut tx = race
                .try_step(&ctx.w2, begin, pgonce::begin(ctx.w2.pool(), level))
                .await?;
            let seen = race
                .try_step(
                    &ctx.w2,
                    "retry: read open incidents",
                    scenario::read_open(&mut tx, entity),
                )
                .await?;
            evaluate(ctx, &ctx.w2, "retry:", &mut outcome).await?;
            if let Some(decision) = Decision::open_if_none(&seen) {
                race.try_step(
                    &ctx.w2,
                    "retry: insert incident",
                    scenario::apply(&mut tx, entity, decision, 2),
                )
                .await?;
            } else {
                race.note(
                    &ctx.w2,
                    "retry: an incident is open already; nothing to create",
                );
            }
            race.try_step(&ctx.w2, "retry: COMMIT", tx.commit()).await?;
        }
    }
    Ok(outcome)
}

/// A session-level advisory lock held from before the read until after the
/// write, across the evaluation: W2 waits for W1's whole evaluation.
async fn session_lock(ctx: &Ctx) -> anyhow::Result<Counts> {
    let mut outcome = Counts::default();
    let (race, entity) = (&ctx.race, &ctx.entity);
    let mut c1 = race
        .try_step(
            &ctx.w1,
            "T01 pg_advisory_lock(entity)",
            session_lock_on(ctx.w1.pool().clone(), entity.clone()),
        )
        .await?;
    let seen1 = race
        .try_step(
            &ctx.w1,
            "T01 read open incidents",
            scenario::read_open(&mut c1, entity),
        )
        .await?;
    evaluate(ctx, &ctx.w1, "T02", &mut outcome).await?;
    let waiting = race
        .step_blocks(
            &ctx.w2,
            "T05 pg_advisory_lock(entity)",
            session_lock_on(ctx.w2.pool().clone(), entity.clone()),
        )
        .await;
    let waiting = match waiting {
        Ok(w) => w,
        Err(HarnessError::DidNotBlock { .. }) => {
            anyhow::bail!("W2 was not blocked by W1's session lock")
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(decision) = Decision::open_if_none(&seen1) {
        race.try_step(
            &ctx.w1,
            "T08 insert incident (autocommit)",
            scenario::apply(&mut c1, entity, decision, 1),
        )
        .await?;
    }
    race.try_step(
        &ctx.w1,
        "T08 pg_advisory_unlock(entity)",
        scenario::unlock_session(&mut c1, entity),
    )
    .await?;
    drop(c1);
    let mut c2 = waiting.try_resume().await?;
    let seen2 = race
        .try_step(
            &ctx.w2,
            "T09 read open incidents",
            scenario::read_open(&mut c2, entity),
        )
        .await?;
    evaluate(ctx, &ctx.w2, "T09", &mut outcome).await?;
    if let Some(decision) = Decision::open_if_none(&seen2) {
        race.try_step(
            &ctx.w2,
            "T10 insert incident",
            scenario::apply(&mut c2, entity, decision, 2),
        )
        .await?;
    } else {
        race.note(
            &ctx.w2,
            "T10 an incident is open already; nothing to create",
        );
    }
    race.try_step(
        &ctx.w2,
        "T10 pg_advisory_unlock(entity)",
        scenario::unlock_session(&mut c2, entity),
    )
    .await?;
    Ok(outcome)
}

/// Checks a connection out and takes the entity's session-level lock on
/// it; the connection stays checked out until the caller drops it.
async fn session_lock_on(pool: PgPool, entity: Entity) -> pgonce::Result<PoolConnection<Postgres>> {
    let mut conn = pool.acquire().await?;
    scenario::lock_session(&mut conn, &entity).await?;
    Ok(conn)
}

/// pgonce's guard: a short read on a connection released before the
/// evaluation, then lock, re-read, compare and write (both workers handle
/// the same message, delivered twice).
async fn guard(ctx: &Ctx) -> anyhow::Result<Counts> {
    let mut outcome = Counts::default();
    let (race, entity) = (&ctx.race, &ctx.entity);
    let guard = Guard::new("race-guard", GuardConfig::default())?;
    let seen1 = race
        .try_step(
            &ctx.w1,
            "T01 guarded read (short, connection released)",
            scenario::read_guarded(&guard, ctx.w1.pool(), entity),
        )
        .await?;
    evaluate(ctx, &ctx.w1, "T02", &mut outcome).await?;
    let seen2 = race
        .try_step(
            &ctx.w2,
            "T05 guarded read (short, connection released)",
            scenario::read_guarded(&guard, ctx.w2.pool(), entity),
        )
        .await?;
    evaluate(ctx, &ctx.w2, "T06", &mut outcome).await?;
    for (w, seen, at) in [(&ctx.w1, &seen1, "T08"), (&ctx.w2, &seen2, "T10")] {
        let Some(decision) = Decision::open_if_none(seen) else {
            race.note(
                w,
                &format!("{at} an incident is open already; nothing to create"),
            );
            continue;
        };
        let done = race
            .try_step(
                w,
                &format!("{at} guarded write: lock, re-read, compare, insert, COMMIT"),
                scenario::write_guarded(&guard, w.pool(), entity, seen, decision, op_of(w)),
            )
            .await?;
        match done.written {
            Written::Refused(Error::Conflict {
                expected, found, ..
            }) => {
                outcome.conflicts += 1;
                race.note(
                    w,
                    &format!("Conflict: expected {expected}, found {found}; nothing written"),
                );
            }
            Written::Refused(e) => return Err(e.into()),
            Written::Opened | Written::Resolved => {}
        }
    }
    Ok(outcome)
}
