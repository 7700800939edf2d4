//! `pgonce race <scenario>`: a seed's interleaving replayed step by step with
//! the harness, under each strategy, with what happened to the invariant.

mod events;
mod guard;
mod jobs;
mod lock_wait;
mod sequence;

use clap::{Args, ValueEnum};
use pgonce_testkit::{Step, StepEvent};

use crate::report::{Report, Row};
use crate::scratch::RunDatabase;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// Session B waits for a transaction-level advisory lock that A holds,
    /// and does not when A takes it outside a transaction.
    LockWait,
    /// The incident seed's duplicate: two workers, one entity, both read
    /// "none open", both evaluate, both create; under six strategies, the
    /// guard among them.
    Guard,
    /// The event-store seed's three DCB writers (A and C on booking:123, B
    /// on booking:456) under each append strategy, and out-of-order commits.
    Events,
    /// The SQS worker seed's duplicate execution: one job delivered twice
    /// under no-guard, where-status, two-phase and dedupe-key; the crashed
    /// claimer; the late completion.
    Jobs,
    /// The incident-numbering seed: concurrent declarations in one
    /// organization and across organizations, under each sequence strategy.
    Sequence,
}

#[derive(Debug, Clone, Args)]
pub struct RaceArgs {
    /// Which scenario to replay.
    pub scenario: Scenario,
}

pub async fn run(args: &RaceArgs, database_url: Option<&str>) -> anyhow::Result<Report> {
    let db = RunDatabase::open(database_url, "race", 20).await?;
    let report = match args.scenario {
        Scenario::LockWait => lock_wait::run(&db).await,
        Scenario::Guard => guard::run(&db).await,
        Scenario::Events => events::run(&db).await,
        Scenario::Jobs => jobs::run(&db).await,
        Scenario::Sequence => sequence::run(&db).await,
    };
    db.close().await?;
    report
}

/// The timeline of one strategy's interleaving as report rows, `T00`, `T01`...
pub fn timeline_rows(strategy: &str, steps: &[Step]) -> Vec<Row> {
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
