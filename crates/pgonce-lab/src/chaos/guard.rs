//! Scenario `guard` (I1): three deliveries of observations for one entity
//! each read the entity's OPEN incidents, decide with no connection held,
//! and open one only if they saw none, through the library's guarded
//! write; a person resolves what is OPEN now and then. A redelivery that
//! read before another delivery's write must be refused.

use rand::Rng;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use sqlx::PgConnection;

use pgonce::{Guard, GuardConfig, LockKey, ReadSet};

use super::Mutant;
use super::faults::{self, FaultKind};
use super::history::Outcome;
use super::round::Round;
use super::schedule::{Action, Step, interleave, sprinkle_faults};

pub const TASKS: usize = 3;
const ENTITY: &str = "entity-1";

pub fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
    let programs = (0..TASKS)
        .map(|task| {
            let mut program = Vec::new();
            for _ in 0..rng.random_range(1..=2) {
                program.extend([Action::Read, Action::Write]);
            }
            if task == 0 && rng.random_bool(0.5) {
                program.push(Action::Close);
            }
            program
        })
        .collect();
    let mut steps = interleave(rng, programs);
    sprinkle_faults(rng, &mut steps, faults, &[], TASKS, 1, 2);
    steps
}

async fn open_incidents(conn: &mut PgConnection, scope: &str) -> pgonce::Result<ReadSet> {
    let ids: Vec<i64> = sqlx::query_scalar(include_str!("sql/guard_open.sql"))
        .bind(scope)
        .bind(ENTITY)
        .fetch_all(conn)
        .await?;
    Ok(ReadSet::from_ids(ids))
}

async fn insert(conn: &mut PgConnection, scope: &str, op: i64) -> pgonce::Result<()> {
    sqlx::query(include_str!("sql/guard_insert.sql"))
        .bind(scope)
        .bind(ENTITY)
        .bind(op)
        .execute(conn)
        .await?;
    Ok(())
}

pub async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    let guard = Guard::new("chaos-open-incident", GuardConfig::default())?;
    let key = LockKey::new("chaos-entity", &format!("{}/{ENTITY}", round.scope))?;
    let scope = round.scope.clone();
    let mut seen: Vec<Option<ReadSet>> = vec![None; round.tasks()];
    for step in steps {
        let task = step.task;
        let pool = round.session(task).clone();
        match step.action {
            Action::Fault { fault, target } => {
                faults::inject_generic(round, task, fault, target).await;
                continue;
            }
            Action::Read => {
                let op = round.history.invoke(task, step.action, Value::Null);
                let read = guard
                    .read(&pool, async |c| open_incidents(c, &scope).await)
                    .await;
                let outcome = match &read {
                    Ok(set) => Outcome::ok(set.ids().collect::<Vec<_>>()),
                    Err(e) => Outcome::error(e),
                };
                round.history.complete(op, outcome);
                round.after_operation(task, read.is_ok());
                seen[task] = read.ok();
            }
            Action::Write => {
                let Some(read) = seen[task].take() else {
                    round.history.skip(task, step.action);
                    continue;
                };
                if !read.is_empty() {
                    // The decision: something is OPEN, nothing to open.
                    round.history.record(
                        task,
                        step.action,
                        json!({ "seen": read.len() }),
                        Outcome::Skipped,
                    );
                    continue;
                }
                let op = round
                    .history
                    .invoke(task, step.action, json!({ "seen": 0 }));
                let written = if round.mutant == Some(Mutant::GuardOff) {
                    // The plain path: write in a transaction of its own,
                    // trusting the earlier read.
                    async {
                        let mut conn = pool.acquire().await?;
                        insert(&mut conn, &scope, op).await
                    }
                    .await
                } else {
                    guard
                        .write(
                            &pool,
                            key,
                            &read,
                            async |c| open_incidents(c, &scope).await,
                            async |c| insert(c, &scope, op).await,
                        )
                        .await
                };
                round.history.finish(op, &written);
                round.after_operation(task, written.is_ok());
            }
            Action::Close => {
                let op = round.history.invoke(task, step.action, Value::Null);
                let closed: pgonce::Result<u64> = sqlx::query(include_str!("sql/guard_close.sql"))
                    .bind(&scope)
                    .bind(ENTITY)
                    .execute(&pool)
                    .await
                    .map(|r| r.rows_affected())
                    .map_err(Into::into);
                round.history.finish(op, &closed);
                round.after_operation(task, closed.is_ok());
            }
            _ => {
                round.history.skip(task, step.action);
            }
        };
    }
    Ok(())
}
