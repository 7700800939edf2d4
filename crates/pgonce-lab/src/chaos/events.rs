//! Scenario `events` (I5): one of the three append strategies, drawn per
//! round, under mixed writers. Conditional writers decide on the round's
//! claims, then append a claim on the condition that none came since;
//! between their two steps other writers append: claims with no
//! condition, events under another tag, and claims through `append_in`
//! in the caller's transaction at each isolation level the strategy
//! accepts. No conditional append may commit above a claim its condition
//! forbids.
//!
//! Each step is one whole append (its transaction begun and ended in the
//! step), so the race this attacks is the stale decision; the commit-order
//! races inside one append are `pgonce race events`'s.

use rand::Rng;
use rand::rngs::StdRng;
use serde_json::{Value, json};

use pgonce::IsolationLevel;
use pgonce::{AppendCondition, AppendStrategy, Event, EventStore, EventStoreConfig, Query};

use super::faults::{self, FaultKind};
use super::history::Outcome;
use super::round::Round;
use super::schedule::{Action, Step, interleave, sprinkle_faults};

pub const TASKS: usize = 4;
/// The event type the conditions are about.
pub const CLAIM: &str = "ChaosClaimed";

pub fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
    let programs = (0..TASKS)
        .map(|task| {
            let mut program = Vec::new();
            for _ in 0..rng.random_range(1..=2) {
                match task {
                    // Conditional writers: decide, then append.
                    0 | 1 => program.extend([Action::Decide, Action::Append]),
                    // A writer with no condition, on the claims' tag or
                    // another.
                    2 => program.push(Action::AppendPlain {
                        other_tag: rng.random_bool(0.5),
                    }),
                    // A claim inside the caller's transaction.
                    _ => program.push(Action::AppendIn {
                        isolation: rng.random_range(0..3),
                    }),
                }
            }
            program
        })
        .collect();
    let mut steps = interleave(rng, programs);
    sprinkle_faults(rng, &mut steps, faults, &[], TASKS, 1, 2);
    // The round's strategy, first, so a replay uses the same one.
    let strategy = rng.random_range(0..AppendStrategy::ALL.len() as u8);
    steps.insert(
        0,
        Step {
            task: 0,
            action: Action::UseStrategy { strategy },
        },
    );
    steps
}

/// The claims' tag of the round.
pub fn claim_tag(scope: &str) -> String {
    format!("claim:{scope}")
}

const ISOLATIONS: [IsolationLevel; 3] = IsolationLevel::ALL;

pub async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    // A schedule shrunk past its first step runs the default strategy.
    let strategy = steps
        .iter()
        .find_map(|s| match s.action {
            Action::UseStrategy { strategy } => AppendStrategy::ALL.get(strategy as usize).copied(),
            _ => None,
        })
        .unwrap_or(AppendStrategy::AdvisoryLocks);
    let tag = claim_tag(&round.scope);
    let query = Query::item([CLAIM], [tag.as_str()])?;
    let mut decisions: Vec<Option<Option<i64>>> = vec![None; round.tasks()];
    for step in steps {
        let task = step.task;
        let store = EventStore::new(
            round.session(task).clone(),
            EventStoreConfig {
                strategy,
                ..EventStoreConfig::default()
            },
        )?;
        let claim = || {
            Event::new(CLAIM)
                .tag(tag.clone())
                .data(json!({ "task": task }))
        };
        match step.action {
            Action::Fault { fault, target } => {
                faults::inject_generic(round, task, fault, target).await;
            }
            Action::Decide => {
                let op = round.history.invoke(task, step.action, Value::Null);
                let decided = store.decide(&query).await;
                round.history.finish(
                    op,
                    &decided
                        .as_ref()
                        .map(|d| json!({ "after": d.after, "seen": d.events.len() })),
                );
                round.after_operation(task, decided.is_ok());
                // The decision: claim only if nothing is claimed yet.
                decisions[task] = decided
                    .ok()
                    .filter(|d| d.events.is_empty())
                    .map(|d| d.after);
            }
            Action::Append => {
                let Some(after) = decisions[task].take() else {
                    round.history.skip(task, step.action);
                    continue;
                };
                let op = round
                    .history
                    .invoke(task, step.action, json!({ "after": after }));
                let condition = AppendCondition::new(query.clone(), after);
                let appended = store.append(&[claim()], Some(&condition)).await;
                round.history.finish(
                    op,
                    &appended
                        .as_ref()
                        .map(|a| json!({ "positions": a.positions })),
                );
                round.after_operation(task, appended.is_ok());
            }
            Action::AppendPlain { other_tag } => {
                let event = if other_tag {
                    Event::new(CLAIM).tag(format!("other:{}", round.scope))
                } else {
                    claim()
                };
                let op = round.history.invoke(task, step.action, Value::Null);
                let appended = store.append(&[event], None).await;
                round.history.finish(
                    op,
                    &appended
                        .as_ref()
                        .map(|a| json!({ "positions": a.positions })),
                );
                round.after_operation(task, appended.is_ok());
            }
            Action::AppendIn { isolation } => {
                // SERIALIZABLE only under the Serializable strategy, which
                // refuses anything else; any level under the others.
                let level = if strategy == AppendStrategy::Serializable {
                    IsolationLevel::Serializable
                } else {
                    ISOLATIONS[isolation as usize % ISOLATIONS.len()]
                };
                let op = round.history.invoke(
                    task,
                    step.action,
                    json!({ "isolation": level.to_string() }),
                );
                let appended = async {
                    let mut tx = pgonce::begin(round.session(task), level).await?;
                    let positions = store.append_in(&mut tx, &[claim()]).await?;
                    tx.commit().await?;
                    Ok::<_, pgonce::Error>(positions)
                }
                .await;
                round
                    .history
                    .finish(op, &appended.as_ref().map(|p| json!({ "positions": p })));
                round.after_operation(task, appended.is_ok());
            }
            Action::UseStrategy { .. } => {
                round.history.record(
                    task,
                    step.action,
                    json!({ "strategy": strategy.name() }),
                    Outcome::Skipped,
                );
            }
            _ => {
                round.history.skip(task, step.action);
            }
        }
    }
    Ok(())
}
