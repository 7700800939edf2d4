//! Scenario `sequence` (I2): three tasks declare in one fresh scope, each
//! declaration BEGIN, number (the sequence scenario's numbered insert,
//! [`crate::scenario::sequence::number`]), COMMIT or ROLLBACK, interleaved
//! step by step by the driver in `stepwise.rs`.

use rand::Rng;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use sqlx::{Postgres, Transaction};

use pgonce::{Sequence, SequenceStrategy};

use super::Mutant;
use super::faults::{self, FaultKind};
use super::history::Outcome;
use super::round::Round;
use super::schedule::{Action, Step, interleave, sprinkle_faults};
use super::stepwise::{self, OpenTransactions, Ran, Stepwise};
use crate::scenario::sequence::{self as scenario, Declared};

pub(crate) const TASKS: usize = 3;

type Tx = Transaction<'static, Postgres>;

pub(crate) fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
    let programs = (0..TASKS)
        .map(|_| {
            let mut program = Vec::new();
            for _ in 0..rng.random_range(1..=2) {
                let end = if rng.random_bool(0.15) {
                    Action::Rollback
                } else {
                    Action::Commit
                };
                program.extend([Action::Begin, Action::Number, end]);
            }
            program
        })
        .collect();
    let mut steps = interleave(rng, programs);
    sprinkle_faults(rng, &mut steps, faults, &[], TASKS, 1, 2);
    steps
}

struct Declarations {
    sequence: Sequence,
}

pub(crate) async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    let strategy = if round.mutant == Some(Mutant::SequenceForUpdate) {
        SequenceStrategy::SelectForUpdate
    } else {
        SequenceStrategy::AdvisoryLock
    };
    let mut declarations = Declarations {
        sequence: scenario::sequence(strategy)?,
    };
    stepwise::run(&mut declarations, round, steps).await
}

impl Stepwise for Declarations {
    type Open = Tx;
    type Done = (Tx, pgonce::Result<i64>);
    const CLOSE: Action = Action::Rollback;

    async fn finished(
        &mut self,
        round: &mut Round,
        open: &mut OpenTransactions<Tx>,
        task: usize,
        op: i64,
        (tx, number): (Tx, pgonce::Result<i64>),
    ) {
        round.history.finish(op, &number);
        round.after_operation(task, number.is_ok());
        if number.is_ok() {
            open.put(task, tx);
        } else {
            // The transaction is aborted (or its connection gone): end it.
            let _ = tx.rollback().await;
        }
    }

    async fn run_step(
        &mut self,
        round: &mut Round,
        open: &mut OpenTransactions<Tx>,
        step: Step,
    ) -> anyhow::Result<Ran<Self::Done>> {
        let task = step.task;
        match step.action {
            Action::Fault { fault, target } => {
                faults::inject_generic(round, task, fault, target).await;
            }
            Action::Begin => {
                if open.is_open(task) {
                    round.history.skip(task, step.action);
                    return Ok(Ran::Finished);
                }
                let op = round.history.invoke(task, step.action, Value::Null);
                let begun = scenario::begin(round.session(task)).await;
                let outcome = match &begun {
                    Ok(_) => Outcome::ok("begun"),
                    Err(e) => Outcome::sqlx(e),
                };
                round.history.complete(op, outcome);
                round.after_operation(task, begun.is_ok());
                if let Ok(tx) = begun {
                    open.put(task, tx);
                }
            }
            Action::Number => {
                let Some(mut tx) = open.take(task) else {
                    round.history.skip(task, step.action);
                    return Ok(Ran::Finished);
                };
                let op = round.history.invoke(task, step.action, Value::Null);
                let sequence = self.sequence.clone();
                let scope = round.scope.clone();
                let step = tokio::spawn(async move {
                    // Recorded as it came: a refusal is an error of the
                    // history, which the checker reads.
                    let number = scenario::number(&sequence, &mut tx, &scope, op)
                        .await
                        .and_then(Declared::into_result)
                        .map(|taken| taken.number);
                    (tx, number)
                });
                return Ok(Ran::Spawned { op, step });
            }
            Action::Commit | Action::Rollback => {
                let Some(tx) = open.take(task) else {
                    round.history.skip(task, step.action);
                    return Ok(Ran::Finished);
                };
                let op = round.history.invoke(task, step.action, Value::Null);
                let ended = if step.action == Action::Commit {
                    tx.commit().await
                } else {
                    tx.rollback().await
                };
                let outcome = match &ended {
                    Ok(()) => Outcome::ok(json!("ended")),
                    Err(e) => Outcome::sqlx(e),
                };
                round.history.complete(op, outcome);
                round.after_operation(task, ended.is_ok());
            }
            _ => {
                round.history.skip(task, step.action);
            }
        }
        Ok(Ran::Finished)
    }
}
