//! One round's world: its scope, its tasks' sessions (one connection
//! each, tagged so a fault can find its backend), its history, and the
//! driver that runs a step until it finishes or is seen blocked.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, Postgres};
use tokio::task::JoinHandle;

use super::faults::FaultKind;
use super::history::History;
use super::{Mutant, Recovery};
use crate::scratch::Restarter;

/// How long a session's pool waits for a connection before its operation
/// fails with `PoolTimedOut`: long enough for a reconnect after a restart
/// on a busy machine, short enough that an exhausted pool costs little.
const ACQUIRE_TIMEOUT: Duration = Duration::from_millis(1500);

/// What a round counted besides its history.
#[derive(Debug, Clone, Default)]
pub(crate) struct RoundStats {
    pub(crate) faults: BTreeMap<FaultKind, u64>,
    pub(crate) recoveries: Vec<Recovery>,
}

impl RoundStats {
    pub(crate) fn fault(&mut self, kind: FaultKind) {
        *self.faults.entry(kind).or_default() += 1;
    }
}

pub(crate) struct Round {
    /// Names this round's rows, locks, queue, job kind and keys.
    pub(crate) scope: String,
    pub(crate) mutant: Option<Mutant>,
    pub(crate) history: History,
    pub(crate) stats: RoundStats,
    /// Per task: the connection held by a pool-exhaustion fault, released
    /// after the task's next operation.
    pub(crate) exhausted: Vec<Option<PoolConnection<Postgres>>>,
    /// Set by a restart: when it began, until an operation succeeds again.
    pub(crate) recovering: Option<Instant>,
    /// Restarters of the run's throwaway cluster, one per restart left
    /// in the schedule; empty on any other server.
    pub(crate) restarters: Vec<Restarter>,
    /// The `pgonce` executable, to start child `pgonce worker` processes
    /// from; `None` where this process is not `pgonce` (tests).
    pub(crate) worker_program: Option<std::path::PathBuf>,
    sessions: Vec<PgPool>,
    names: Vec<String>,
    control: PgPool,
    options: PgConnectOptions,
}

impl Round {
    pub(crate) async fn open(
        options: &PgConnectOptions,
        control: PgPool,
        scope: String,
        tasks: usize,
        mutant: Option<Mutant>,
        restarters: Vec<Restarter>,
    ) -> anyhow::Result<Round> {
        let mut sessions = Vec::with_capacity(tasks);
        let mut names = Vec::with_capacity(tasks);
        for task in 0..tasks {
            let name = format!("pgonce-chaos:{scope}:t{task}");
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .connect_lazy_with(options.clone().application_name(&name));
            sessions.push(pool);
            names.push(name);
        }
        Ok(Round {
            scope,
            mutant,
            history: History::default(),
            stats: RoundStats::default(),
            exhausted: (0..tasks).map(|_| None).collect(),
            recovering: None,
            restarters,
            worker_program: None,
            sessions,
            names,
            control,
            options: options.clone(),
        })
    }

    pub(crate) fn tasks(&self) -> usize {
        self.sessions.len()
    }

    /// Task `task`'s pool: one connection.
    pub(crate) fn session(&self, task: usize) -> &PgPool {
        &self.sessions[task]
    }

    /// Its `application_name`.
    pub(crate) fn session_name(&self, task: usize) -> &str {
        &self.names[task]
    }

    /// Options for the round's database, for pools of a scenario's own.
    pub(crate) fn options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// A pool outside every task, for faults, drains and checks.
    pub(crate) fn control(&self) -> &PgPool {
        &self.control
    }

    /// After each operation of `task`: the pool it exhausted is released,
    /// and a success after a restart ends the recovery.
    pub(crate) fn after_operation(&mut self, task: usize, succeeded: bool) {
        self.exhausted[task] = None;
        if succeeded && let Some(started) = self.recovering.take() {
            self.stats.recoveries.push(Recovery {
                after: "restart",
                millis: started.elapsed().as_millis() as u64,
            });
        }
    }

    /// Runs `step` (spawned) until it finishes or its session is seen
    /// waiting on a lock. Only the database's lock table decides, so a
    /// step waiting on another task's lock stops there on every run. A
    /// lock held by something on its way out (a terminated backend still
    /// exiting, a dropped transaction's rollback not yet sent) can make a
    /// step wait briefly on one run and not on another; that changes the
    /// order of later steps, never a verdict, which rests on the history
    /// and the tables.
    pub(crate) async fn settle<T: Send + 'static>(
        &self,
        task: usize,
        step: JoinHandle<T>,
    ) -> anyhow::Result<Settled<T>> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if step.is_finished() {
                return Ok(Settled::Done(step.await.context("a step panicked")?));
            }
            let blocked: bool = sqlx::query_scalar(include_str!("sql/is_blocked.sql"))
                .bind(self.session_name(task))
                .fetch_one(&self.control)
                .await?;
            if blocked {
                return Ok(Settled::Blocked(step));
            }
            if Instant::now() > deadline {
                step.abort();
                anyhow::bail!("task {task} neither finished nor blocked within 60 s");
            }
            // Polling the lock table; the verdict never rests on this pause.
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    pub(crate) async fn close(self) {
        drop(self.exhausted);
        for pool in self.sessions {
            pool.close().await;
        }
    }
}

/// Where [`Round::settle`] left a step.
pub(crate) enum Settled<T> {
    Done(T),
    Blocked(JoinHandle<T>),
}
