//! `pgonce race <scenario>`: a race's interleaving replayed step by step with
//! the harness, under each strategy, with what happened to the invariant.

pub mod events;
pub mod events_late_writer;
pub mod guard;
pub mod jobs;
pub mod lock_wait;
pub mod sequence;

use clap::{Args, ValueEnum};
use std::future::Future;

use pgonce_testkit::{Blocked, HarnessError, Interleaving, Session, Step, StepEvent};
use tokio::sync::oneshot;

use crate::report::{Report, Row};
use crate::scratch::RunDatabase;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Scenario {
    /// Session B waits for a transaction-level advisory lock that A holds,
    /// and does not when A takes it outside a transaction.
    LockWait,
    /// The duplicate incident: two workers, one entity, both read "none
    /// open", both evaluate, both create; under six strategies, the guard
    /// among them.
    Guard,
    /// The DCB event store's three writers (A and C on booking:123, B on
    /// booking:456) under each append strategy, and out-of-order commits.
    Events,
    /// An append without a condition holds a lower position open while a
    /// conditional append that decided before it checks, under each append
    /// strategy, through `begin_append` and through `append_in`.
    EventsLateWriter,
    /// An SQS worker's duplicate execution: one job delivered twice under
    /// no-guard, where-status, two-phase and dedupe-key; the crashed claimer;
    /// the late completion.
    Jobs,
    /// Incident numbering: concurrent declarations in one organization and
    /// across organizations, under each sequence strategy.
    Sequence,
}

/// `pgonce race`'s arguments: the scenario to replay.
#[derive(Debug, Clone, Args)]
pub struct RaceArgs {
    /// Which scenario to replay.
    pub(crate) scenario: Scenario,
}

/// The command: replays the scenario on a scratch database and reports
/// each strategy's outcome and timeline.
pub async fn run(args: &RaceArgs, database_url: Option<&str>) -> anyhow::Result<Report> {
    let db = RunDatabase::open(database_url, "race", 20).await?;
    let report = match args.scenario {
        Scenario::LockWait => lock_wait::run(&db).await,
        Scenario::Guard => guard::run(&db).await,
        Scenario::Events => events::run(&db).await,
        Scenario::EventsLateWriter => events_late_writer::run(&db).await,
        Scenario::Jobs => jobs::run(&db).await,
        Scenario::Sequence => sequence::run(&db).await,
    };
    db.close().await?;
    report
}

/// The timeline of one strategy's interleaving as report rows, `T00`, `T01`...
pub(crate) fn timeline_rows(strategy: &str, steps: &[Step]) -> Vec<Row> {
    steps
        .iter()
        .map(|s| {
            let event = match &s.event {
                StepEvent::Ran => "ran".to_string(),
                StepEvent::Blocked { by } => format!("waits for {}", by.join(", ")),
                StepEvent::Resumed => "proceeds".to_string(),
                StepEvent::Note => "note".to_string(),
            };
            Row::new(strategy)
                .with("t", format!("T{:02}", s.at))
                .with("session", &s.session)
                .with("step", &s.what)
                .with("event", event)
        })
        .collect()
}

/// A step that may or may not wait on a lock: seen blocked (and on whom), or
/// run to completion without waiting. Its output comes back either way.
pub(crate) struct MaybeBlocked<T> {
    blocked: Option<Blocked<()>>,
    pub(crate) waited_for: Vec<String>,
    output: oneshot::Receiver<T>,
}

impl<T> MaybeBlocked<T> {
    pub(crate) async fn finish(self) -> anyhow::Result<T> {
        if let Some(blocked) = self.blocked {
            blocked.resume().await?;
        }
        Ok(self.output.await?)
    }
}

pub(crate) async fn maybe_blocks<T: Send + 'static>(
    race: &Interleaving,
    session: &Session,
    what: &str,
    step: impl Future<Output = T> + Send + 'static,
) -> anyhow::Result<MaybeBlocked<T>> {
    let (send, output) = oneshot::channel();
    let step = async move {
        let _ = send.send(step.await);
    };
    match race.step_blocks(session, what, step).await {
        Ok(blocked) => Ok(MaybeBlocked {
            waited_for: blocked.blocked_by().to_vec(),
            blocked: Some(blocked),
            output,
        }),
        Err(HarnessError::DidNotBlock { .. }) => {
            race.note(session, &format!("{what}: ran without waiting"));
            Ok(MaybeBlocked {
                blocked: None,
                waited_for: Vec::new(),
                output,
            })
        }
        Err(e) => Err(e.into()),
    }
}
