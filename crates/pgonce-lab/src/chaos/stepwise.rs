//! The step-by-step driver of the scenarios whose tasks hold a
//! transaction open across other tasks' steps (`sequence`, `events`). A
//! step that waits on a lock is left waiting (the lock table says so,
//! [`Round::settle`]) and the task's later steps are deferred behind it,
//! the way PostgreSQL's isolation tester runs a permutation. At the end of
//! the round every transaction still open is ended by the scenario's
//! closing step, which lets every waiting step finish.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use super::round::{Round, Settled};
use super::schedule::{Action, Step};

/// A scenario the driver runs.
pub(crate) trait Stepwise {
    /// What a task holds open between its steps (a transaction, a pending
    /// append).
    type Open: Send + 'static;
    /// What a step that may wait on a lock hands back when it finishes.
    type Done: Send + 'static;

    /// The step that ends a task's open transaction when the round is
    /// over (a rollback).
    const CLOSE: Action;

    /// Runs `step` of a task with no step waiting. A step that may wait
    /// spawns itself and returns [`Ran::Spawned`]; the driver settles it.
    async fn run_step(
        &mut self,
        round: &mut Round,
        open: &mut OpenTransactions<Self::Open>,
        step: Step,
    ) -> anyhow::Result<Ran<Self::Done>>;

    /// A spawned step of `task` (operation `op`) finished with `done`.
    async fn finished(
        &mut self,
        round: &mut Round,
        open: &mut OpenTransactions<Self::Open>,
        task: usize,
        op: i64,
        done: Self::Done,
    );
}

/// How far [`Stepwise::run_step`] went.
pub(crate) enum Ran<D> {
    /// The step is over.
    Finished,
    /// The step runs in `step`, for operation `op`, and may wait on a lock.
    Spawned { op: i64, step: JoinHandle<D> },
}

/// What each task holds open.
pub(crate) struct OpenTransactions<O>(Vec<Option<O>>);

impl<O> OpenTransactions<O> {
    /// Takes what `task` holds open (the step that uses it puts it back).
    pub(crate) fn take(&mut self, task: usize) -> Option<O> {
        self.0[task].take()
    }

    pub(crate) fn put(&mut self, task: usize, open: O) {
        self.0[task] = Some(open);
    }

    pub(crate) fn is_open(&self, task: usize) -> bool {
        self.0[task].is_some()
    }
}

struct Driver<S: Stepwise> {
    open: OpenTransactions<S::Open>,
    /// Per task: a step still waiting on a lock, its op and its future.
    waiting: Vec<Option<(i64, JoinHandle<S::Done>)>>,
    deferred: VecDeque<Step>,
}

/// Runs `steps` of `scenario`.
pub(crate) async fn run<S: Stepwise>(
    scenario: &mut S,
    round: &mut Round,
    steps: &[Step],
) -> anyhow::Result<()> {
    let tasks = round.tasks();
    let mut d = Driver::<S> {
        open: OpenTransactions((0..tasks).map(|_| None).collect()),
        waiting: (0..tasks).map(|_| None).collect(),
        deferred: VecDeque::new(),
    };
    for step in steps {
        // A task with a step deferred defers the rest too, so its steps
        // keep their order even when its wait ended on its own.
        let behind = d.deferred.iter().any(|s| s.task == step.task);
        if behind || !d.runnable(scenario, round, step.task).await? {
            d.deferred.push_back(*step);
            continue;
        }
        d.run_step(scenario, round, *step).await?;
        d.run_deferred(scenario, round).await?;
    }
    // The end of the round: whatever is still open is closed, which lets
    // every waiting step finish.
    let mut stuck_since: Option<Instant> = None;
    loop {
        d.run_deferred(scenario, round).await?;
        let idle_open = (0..tasks).find(|&t| d.open.is_open(t) && d.waiting[t].is_none());
        if let Some(task) = idle_open {
            let close = Step {
                task,
                action: S::CLOSE,
            };
            d.run_step(scenario, round, close).await?;
            stuck_since = None;
            continue;
        }
        let waiting: Vec<usize> = (0..tasks).filter(|&t| d.waiting[t].is_some()).collect();
        if waiting.is_empty() {
            break;
        }
        // Collect every waiting step: one that finished may hold what the
        // others wait for (an append begun, not yet ended).
        let mut progressed = false;
        for task in waiting {
            progressed |= d.runnable(scenario, round, task).await?;
        }
        if progressed {
            stuck_since = None;
            continue;
        }
        // Every step left waits, and no task of the round holds anything
        // open: what they wait for is on its way out (a terminated
        // backend still exiting, a dropped transaction's rollback not yet
        // sent, an autovacuum giving way to a table lock). Look again,
        // for a bounded time.
        let since = *stuck_since.get_or_insert_with(Instant::now);
        if since.elapsed() > OUTSIDE_HOLDER_PATIENCE {
            anyhow::bail!(
                "tasks wait on a lock no task of the round holds, for over {} s",
                OUTSIDE_HOLDER_PATIENCE.as_secs()
            );
        }
        // Polling the lock table again; no verdict rests on this pause.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// How long the end of a round waits for a lock held by no task of the
/// round to go away before it gives up.
const OUTSIDE_HOLDER_PATIENCE: Duration = Duration::from_secs(60);

impl<S: Stepwise> Driver<S> {
    /// Whether `task` can take its next step: no step of it still waits.
    /// A waiting step that finished is collected here.
    async fn runnable(
        &mut self,
        scenario: &mut S,
        round: &mut Round,
        task: usize,
    ) -> anyhow::Result<bool> {
        let Some((op, step)) = self.waiting[task].take() else {
            return Ok(true);
        };
        self.settle(scenario, round, task, op, step).await?;
        Ok(self.waiting[task].is_none())
    }

    async fn settle(
        &mut self,
        scenario: &mut S,
        round: &mut Round,
        task: usize,
        op: i64,
        step: JoinHandle<S::Done>,
    ) -> anyhow::Result<()> {
        match round.settle(task, step).await? {
            Settled::Done(done) => {
                scenario
                    .finished(round, &mut self.open, task, op, done)
                    .await
            }
            Settled::Blocked(step) => self.waiting[task] = Some((op, step)),
        }
        Ok(())
    }

    async fn run_step(
        &mut self,
        scenario: &mut S,
        round: &mut Round,
        step: Step,
    ) -> anyhow::Result<()> {
        if let Ran::Spawned { op, step: spawned } =
            scenario.run_step(round, &mut self.open, step).await?
        {
            self.settle(scenario, round, step.task, op, spawned).await?;
        }
        Ok(())
    }

    async fn run_deferred(&mut self, scenario: &mut S, round: &mut Round) -> anyhow::Result<()> {
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
                if self.runnable(scenario, round, step.task).await? {
                    self.deferred.remove(i);
                    self.run_step(scenario, round, step).await?;
                    progressed = true;
                    break;
                }
            }
        }
        Ok(())
    }
}
