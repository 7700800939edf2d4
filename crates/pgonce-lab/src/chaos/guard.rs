//! Scenario `guard` (I1): three deliveries of observations for one entity
//! each read the entity's OPEN incidents, decide with no connection held,
//! and open one only if they saw none, through the library's guarded
//! write; a person resolves what is OPEN now and then. A redelivery that
//! read before another delivery's write must be refused. The scenario's
//! rows and writes are [`crate::scenario::guard`]'s; this file draws the
//! schedule and records the history.

use rand::Rng;
use rand::rngs::StdRng;
use serde_json::{Value, json};

use pgonce::{Guard, GuardConfig, ReadSet};

use super::Mutant;
use super::faults::{self, FaultKind};
use super::history::Outcome;
use super::round::Round;
use super::schedule::{Action, Step, interleave, sprinkle_faults};
use crate::scenario::guard::{self as scenario, Decision, Entity, Written};

pub(crate) const TASKS: usize = 3;
const ENTITY: &str = "entity-1";

pub(crate) fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
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

pub(crate) async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    let guard = Guard::new("chaos-open-incident", GuardConfig::default())?;
    let entity = Entity::new(round.scope.clone(), ENTITY);
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
                let read = scenario::read_guarded(&guard, &pool, &entity).await;
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
                let Some(decision) = Decision::open_if_none(&read) else {
                    // Something is OPEN: nothing to open.
                    round.history.record(
                        task,
                        step.action,
                        json!({ "seen": read.len() }),
                        Outcome::Skipped,
                    );
                    continue;
                };
                let op = round
                    .history
                    .invoke(task, step.action, json!({ "seen": 0 }));
                let written = if round.mutant == Some(Mutant::GuardOff) {
                    // The plain path: write in a transaction of its own,
                    // trusting the earlier read.
                    scenario::write_plain(&pool, &entity, decision, op).await
                } else {
                    scenario::write_guarded(&guard, &pool, &entity, &read, decision, op)
                        .await
                        .map(|g| g.written)
                };
                let outcome = match &written {
                    Ok(Written::Refused(e)) | Err(e) => Outcome::error(e),
                    Ok(_) => Outcome::ok(Value::Null),
                };
                let ok = outcome.is_ok();
                round.history.complete(op, outcome);
                round.after_operation(task, ok);
            }
            Action::Close => {
                let op = round.history.invoke(task, step.action, Value::Null);
                let closed = async {
                    let mut conn = pool.acquire().await?;
                    scenario::resolve(&mut conn, &entity).await
                }
                .await;
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
