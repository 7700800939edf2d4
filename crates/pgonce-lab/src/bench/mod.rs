//! `pgonce bench <suite>`: strategies side by side in one run, with ratios.
//! Every suite takes `--quick` (same scenarios, smaller, under 30 s) for CI.

mod events;
mod guard;
mod jobs;
mod lock;
pub(crate) mod measure;
mod peers;
pub(crate) mod queue;
mod sequence;
mod service;

use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};

use crate::report::Report;
use crate::scratch::RunDatabase;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Suite {
    /// Cost of a transaction-level advisory lock in a short write transaction.
    Lock,
    /// The guarded write against two-transactions, serializable and
    /// a session lock: low contention, hot entity, pool pressure.
    Guard,
    /// Concurrent incident declarations per scope under each sequence
    /// strategy: S scopes x C declarers, number taken early or late.
    Sequence,
    /// DCB appends: three strategies, disjoint to fully conflicting tags.
    Events,
    /// Send + receive + delete through pgonce's queue, the raw INSERT/DELETE
    /// limit and a queue crate from crates.io.
    Queue,
    /// Claim-to-complete throughput of pgonce's jobs against sqlxmq, and
    /// duplicate side effects under forced redelivery per guard.
    Jobs,
    /// The incident service: 50 declarers in one organization while the
    /// pipeline opens incidents there, per numbering strategy; p99 against
    /// the 3 s declaration SLO, and pipeline observations/s.
    Service,
}

/// `pgonce bench`'s arguments: the suite, and how long and how often to
/// measure it.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Which suite to run.
    pub(crate) suite: Suite,
    /// The same scenarios, smaller: the whole suite in under 30 seconds.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Seconds to measure each strategy (default: 5, or 1.5 with --quick),
    /// above 0 and at most 3600.
    #[arg(long, value_parser = phase_seconds)]
    pub(crate) seconds: Option<f64>,
    /// Runs the compared strategies this many times, alternating which goes
    /// first, and reports the median of each ratio with every run's value
    /// (suites that support it: guard, sequence, service).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub(crate) repeat: u32,
    /// Also draws the run's figures (throughput, latency percentiles,
    /// ratios against their goals) as an SVG file here.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) plot: Option<std::path::PathBuf>,
}

/// `--seconds`: a number above 0 and at most an hour (it becomes a
/// `Duration`, which holds neither infinity nor NaN).
fn phase_seconds(text: &str) -> Result<f64, String> {
    let seconds: f64 = text.parse().map_err(|e| format!("{e}"))?;
    if seconds.is_finite() && seconds > 0.0 && seconds <= 3600.0 {
        Ok(seconds)
    } else {
        Err("a number of seconds above 0 and at most 3600".into())
    }
}

impl BenchArgs {
    /// How long to measure one strategy in one scenario.
    pub(crate) fn phase(&self) -> Duration {
        let default = if self.quick { 1.5 } else { 5.0 };
        Duration::from_secs_f64(self.seconds.unwrap_or(default).max(0.1))
    }
}

/// The command: runs the suite on a scratch database and reports what it
/// measured, with the ratios between strategies.
pub async fn run(args: &BenchArgs, database_url: Option<&str>) -> anyhow::Result<Report> {
    let name = args.suite.to_possible_value().expect("no skipped suites");
    if let Some(path) = &args.plot {
        // Before the run, not after it: a path that cannot be written
        // would otherwise fail the command at its end and lose the run.
        // Opened to append, so that a plot already there is left as it is
        // if this run fails, and removed again if this made it.
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("--plot: cannot write {}", path.display()))?;
        if !existed {
            std::fs::remove_file(path).ok();
        }
    }
    let db = RunDatabase::open(database_url, "bench", 200).await?;
    let report = match args.suite {
        Suite::Lock => lock::run(args, &db).await,
        Suite::Guard => guard::run(args, &db).await,
        Suite::Sequence => sequence::run(args, &db).await,
        Suite::Events => events::run(args, &db).await,
        Suite::Queue => queue::run(args, &db).await,
        Suite::Jobs => jobs::run(args, &db, database_url).await,
        Suite::Service => service::run(args, &db).await,
    };
    db.close().await?;
    let mut report = report?;
    report.name = name.get_name().to_string();
    if let Some(path) = &args.plot {
        // A write can still fail after the check above (a full disk, a
        // file that takes no data): the report is printed all the same,
        // its verdict saying the plot is missing: unfinished, no violation.
        if let Err(e) = crate::plot::write(&report, path) {
            report
                .verdict
                .finished(false, format!("the plot was not written: {e:#}"));
        }
    }
    Ok(report)
}
