//! Scenario `sequence` (I2): three tasks declare in one fresh scope, each
//! declaration BEGIN, number (the library's `Sequence::next`, then the
//! row), COMMIT or ROLLBACK, interleaved step by step. A step that waits
//! on a lock is left waiting (the lock table says so) and the task's later
//! steps wait for it, the way PostgreSQL's isolation tester runs a
//! permutation.

use std::collections::VecDeque;

use rand::Rng;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use sqlx::{Postgres, Transaction};
use tokio::task::JoinHandle;

use pgonce::{NumberedTable, Sequence, SequenceConfig, SequenceStrategy};

use super::Mutant;
use super::faults::{self, FaultKind};
use super::history::Outcome;
use super::round::{Round, Settled};
use super::schedule::{Action, Step, interleave, sprinkle_faults};

pub const TASKS: usize = 3;

type Tx = Transaction<'static, Postgres>;
type NumberStep = JoinHandle<(Tx, pgonce::Result<i64>)>;

pub fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
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

#[derive(Default)]
struct Task {
    tx: Option<Tx>,
    /// A number step still waiting on a lock: its op and its future.
    waiting: Option<(i64, NumberStep)>,
}

struct Declarations {
    sequence: Sequence,
    tasks: Vec<Task>,
    deferred: VecDeque<Step>,
}

pub async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    let strategy = if round.mutant == Some(Mutant::SequenceForUpdate) {
        SequenceStrategy::SelectForUpdate
    } else {
        SequenceStrategy::AdvisoryLock
    };
    let mut d = Declarations {
        sequence: Sequence::new(
            NumberedTable::new("public.chaos_numbered", "scope", "number")?,
            SequenceConfig { strategy },
        )?,
        tasks: (0..round.tasks()).map(|_| Task::default()).collect(),
        deferred: VecDeque::new(),
    };
    for step in steps {
        if !d.runnable(round, step.task).await? {
            d.deferred.push_back(*step);
            continue;
        }
        d.run_step(round, *step).await?;
        d.run_deferred(round).await?;
    }
    // The end of the round: whatever is still open rolls back, which lets
    // every waiting step finish.
    loop {
        d.run_deferred(round).await?;
        let idle_open =
            (0..d.tasks.len()).find(|&t| d.tasks[t].tx.is_some() && d.tasks[t].waiting.is_none());
        if let Some(task) = idle_open {
            d.run_step(
                round,
                Step {
                    task,
                    action: Action::Rollback,
                },
            )
            .await?;
            continue;
        }
        let Some(task) = (0..d.tasks.len()).find(|&t| d.tasks[t].waiting.is_some()) else {
            break;
        };
        if !d.runnable(round, task).await? {
            anyhow::bail!("task {task} waits on a lock nobody in the round holds");
        }
    }
    Ok(())
}

impl Declarations {
    /// Whether `task` can take its next step: no step of it still waits.
    /// A waiting step that finished is collected here.
    async fn runnable(&mut self, round: &mut Round, task: usize) -> anyhow::Result<bool> {
        let Some((op, step)) = self.tasks[task].waiting.take() else {
            return Ok(true);
        };
        match round.settle(task, step).await? {
            Settled::Done((tx, number)) => {
                self.numbered(round, task, op, tx, number).await;
                Ok(true)
            }
            Settled::Blocked(step) => {
                self.tasks[task].waiting = Some((op, step));
                Ok(false)
            }
        }
    }

    async fn run_deferred(&mut self, round: &mut Round) -> anyhow::Result<()> {
        let mut progressed = true;
        while progressed {
            progressed = false;
            for i in 0..self.deferred.len() {
                let step = self.deferred[i];
                // A task's steps keep their order: only its first deferred
                // step may run.
                if self.deferred.iter().take(i).any(|s| s.task == step.task) {
                    continue;
                }
                if self.runnable(round, step.task).await? {
                    self.deferred.remove(i);
                    self.run_step(round, step).await?;
                    progressed = true;
                    break;
                }
            }
        }
        Ok(())
    }

    async fn numbered(
        &mut self,
        round: &mut Round,
        task: usize,
        op: i64,
        tx: Tx,
        number: pgonce::Result<i64>,
    ) {
        round.history.finish(op, &number);
        round.after_operation(task, number.is_ok());
        if number.is_ok() {
            self.tasks[task].tx = Some(tx);
        } else {
            // The transaction is aborted (or its connection gone): end it.
            let _ = tx.rollback().await;
        }
    }

    async fn run_step(&mut self, round: &mut Round, step: Step) -> anyhow::Result<()> {
        let task = step.task;
        let skipped = |round: &mut Round| {
            round.history.skip(task, step.action);
        };
        match step.action {
            Action::Fault { fault, target } => {
                faults::inject_generic(round, task, fault, target).await;
            }
            Action::Begin => {
                if self.tasks[task].tx.is_some() {
                    skipped(round);
                    return Ok(());
                }
                let op = round.history.invoke(task, step.action, Value::Null);
                let begun =
                    pgonce::begin(round.session(task), pgonce::IsolationLevel::ReadCommitted).await;
                let outcome = match &begun {
                    Ok(_) => Outcome::ok("begun"),
                    Err(e) => Outcome::sqlx(e),
                };
                round.history.complete(op, outcome);
                round.after_operation(task, begun.is_ok());
                self.tasks[task].tx = begun.ok();
            }
            Action::Number => {
                let Some(mut tx) = self.tasks[task].tx.take() else {
                    skipped(round);
                    return Ok(());
                };
                let op = round.history.invoke(task, step.action, Value::Null);
                let sequence = self.sequence.clone();
                let scope = round.scope.clone();
                let handle: NumberStep = tokio::spawn(async move {
                    let number = async {
                        let taken = sequence.next(&mut tx, &scope).await?;
                        sqlx::query(include_str!("sql/sequence_insert.sql"))
                            .bind(&scope)
                            .bind(taken.number)
                            .bind(op)
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| sequence.number_taken(e.into(), &scope, taken.number))?;
                        Ok(taken.number)
                    }
                    .await;
                    (tx, number)
                });
                match round.settle(task, handle).await? {
                    Settled::Done((tx, number)) => self.numbered(round, task, op, tx, number).await,
                    Settled::Blocked(handle) => self.tasks[task].waiting = Some((op, handle)),
                }
            }
            Action::Commit | Action::Rollback => {
                let Some(tx) = self.tasks[task].tx.take() else {
                    skipped(round);
                    return Ok(());
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
            _ => skipped(round),
        }
        Ok(())
    }
}
