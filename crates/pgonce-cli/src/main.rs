//! `pgonce`: the command-line face of pgonce. Parses arguments, sets up
//! logging and hands over to the library; nothing here decides anything.
//!
//! The product's commands (`migrate`, `serve`, `worker`, `rollout`) are
//! always here. The lab's (`demo`, `race`, `bench`, `chaos`) come with the `lab`
//! feature, from the `pgonce-lab` crate: one command for users, and a
//! deployed server that links no benchmark peer, no second sqlx and no
//! test kit.

mod database;
mod serve;
mod stop;

use std::process::ExitCode;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[cfg(feature = "lab")]
use pgonce_lab::{bench, chaos, demo, race, report::Report};

use crate::stop::{Interrupted, ServiceStop, StopSignals};

/// What a command leaves to print: the lab's reports; the product's
/// commands print nothing on stdout.
#[cfg(not(feature = "lab"))]
enum Report {}

/// Database safeguards for at-least-once queue workers on PostgreSQL.
///
// The lab's sentences only in the build that has its commands: the
// product's help named commands it does not have.
#[cfg_attr(
    feature = "lab",
    doc = "Without --database-url (or DATABASE_URL), `demo`, `race`, `bench` and \
           `chaos` start a throwaway PostgreSQL cluster from the installed binaries and \
           remove it when they finish."
)]
/// Logs go to stderr; RUST_LOG sets the level.
#[derive(Debug, Parser)]
#[command(name = "pgonce", version, about, long_about)]
struct Cli {
    /// PostgreSQL to use, e.g. postgres://user@host:5432/db.
    #[cfg_attr(
        feature = "lab",
        doc = "`race`, `bench`, `demo` and `chaos` create (and drop) a scratch database \
               on that server."
    )]
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,

    /// Print exactly one JSON object on stdout instead of tables (`race`,
    /// `bench`, `demo`, `chaos`; the other commands refuse it).
    #[cfg(feature = "lab")]
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the library's migrations (the `pgonce` schema) to the
    /// database of the configuration `serve` reads (--config,
    /// PGONCE_DATABASE__URL, DATABASE_URL, --database-url), over its
    /// `database.direct_url` when set. The incident service's own schema
    /// is applied by `serve`, `worker` and `rollout PERCENT`.
    Migrate(serve::MigrateArgs),
    #[cfg(feature = "lab")]
    /// Replay a race step by step under each strategy.
    Race(race::RaceArgs),
    #[cfg(feature = "lab")]
    /// Compare strategies side by side under load; prints ratios.
    Bench(bench::BenchArgs),
    #[cfg(feature = "lab")]
    /// The main job: run the incident service end to end on a throwaway
    /// database, under redeliveries, duplicates and a killed worker, and
    /// check every invariant. Exit 0 iff all hold and the run finished; 1
    /// when one broke, 3 when it could not finish (a stall, an error).
    Demo(demo::DemoArgs),
    #[cfg(feature = "lab")]
    /// An adversary: concurrent workloads under injected faults, their
    /// history checked against the invariants. Exit 0 iff none broke.
    Chaos(chaos::ChaosArgs),
    /// Run the incident service: HTTP API and background workers, until
    /// Ctrl-C or SIGTERM (then drains; a second signal stops at once).
    Serve(serve::ServeArgs),
    /// Run the incident service's background workers only, until Ctrl-C or
    /// SIGTERM (then drains; a second signal stops at once).
    Worker(serve::WorkerArgs),
    /// Show, or set, the percent of entities on the guarded write path
    /// (takes effect without a restart).
    Rollout(serve::RolloutArgs),
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // A global flag, so that it goes anywhere on a lab command's line; the
    // product's commands print no report, and refuse it rather than print
    // text to a caller that asked for JSON.
    #[cfg(feature = "lab")]
    if cli.json
        && matches!(
            cli.command,
            Command::Migrate(_) | Command::Serve(_) | Command::Worker(_) | Command::Rollout(_)
        )
    {
        Cli::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--json is for the lab's reports (race, bench, demo, chaos); \
                 migrate, serve, worker and rollout print none",
            )
            .exit();
    }
    // The configuration (`migrate`, `serve`, `worker`, `rollout`) reads
    // DATABASE_URL itself, below its own PGONCE_DATABASE__URL: only a
    // --database-url typed on the command line overrides it.
    let flag_url = matches.value_source("database_url") == Some(ValueSource::CommandLine);
    // sqlx warns about every statement slower than a second; in races and
    // benchmarks those are lock waits we cause on purpose. The demo causes
    // conflicts, stale acks and failed sends on purpose and counts them in
    // its report; RUST_LOG=warn shows each one.
    let default_filter = match cli.command {
        #[cfg(feature = "lab")]
        Command::Demo(_) => "error,pgonce_lab=info",
        // The adversary causes terminated backends, stale receipts and lost
        // leases on purpose; its history and report hold each one.
        #[cfg(feature = "lab")]
        Command::Chaos(_) => "error",
        _ => "warn,pgonce=info,sqlx::query=error",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .init();

    // Only the lab's commands make a throwaway database or cluster (a
    // product command stopped by a signal has none to speak of), and only
    // theirs end in a report, whose run an error left unfinished.
    #[cfg(feature = "lab")]
    let lab = matches!(
        cli.command,
        Command::Race(_) | Command::Bench(_) | Command::Demo(_) | Command::Chaos(_)
    );
    #[cfg(not(feature = "lab"))]
    let lab = false;
    let service = matches!(cli.command, Command::Serve(_) | Command::Worker(_));
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let outcome = runtime.block_on(async {
        let mut signals = StopSignals::listen().context("installing the signal handlers")?;
        // A service drains on its first signal once it runs (see `stop`);
        // any other command stops on its first.
        let stop = ServiceStop::default();
        let stopped = async {
            if service {
                stop.stop_now(&mut signals).await
            } else {
                signals.next().await
            }
        };
        tokio::select! {
            outcome = run(&cli, flag_url, &stop) => outcome,
            interrupted = stopped => Err(interrupted.into()),
        }
        // Leaving the select drops the command's future, and with it any
        // throwaway cluster, which stops the server and removes its files;
        // a service's runtime, whose unacked messages the queue redelivers.
    });
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    match outcome {
        #[cfg(feature = "lab")]
        Ok(Some(report)) => {
            report.print(cli.json);
            // 0 ok, 1 a violation, 3 a run that could not finish.
            ExitCode::from(report.verdict.outcome().exit_code())
        }
        #[cfg(not(feature = "lab"))]
        Ok(Some(never)) => match never {},
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<Interrupted>() {
            Some(Interrupted {
                signal,
                code,
                while_draining,
            }) => {
                if *while_draining {
                    eprintln!(
                        "pgonce: interrupted again ({signal}) while stopping: stopped at once; \
                         messages in hand are redelivered after their visibility timeout, \
                         claimed notifications sent again after their lease"
                    );
                } else if lab {
                    eprintln!("pgonce: interrupted ({signal}); throwaway database removed");
                } else {
                    eprintln!("pgonce: interrupted ({signal})");
                }
                ExitCode::from(*code)
            }
            None => {
                eprintln!("pgonce: error: {}", one_line(&e));
                error_exit_code(lab)
            }
        },
    }
}

/// The exit code of a command that ended in an error. A lab command's
/// (`lab`) is a run that could not finish, which is not a violation: its
/// exit code is the one its report would have had.
fn error_exit_code(lab: bool) -> ExitCode {
    #[cfg(feature = "lab")]
    if lab {
        return ExitCode::from(pgonce_lab::report::EXIT_UNFINISHED);
    }
    let _ = lab;
    ExitCode::FAILURE
}

/// The error and its causes on one line, each cause's text once: a cause
/// whose text its parent already carries is left out (libraries often
/// embed their source's text and return it as the source too).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line.replace('\n', " ")
}

/// `flag_url`: `--database-url` was given on the command line (not only
/// read from DATABASE_URL).
/// `stop`: a service's, for `serve` and `worker`.
async fn run(cli: &Cli, flag_url: bool, stop: &ServiceStop) -> anyhow::Result<Option<Report>> {
    let url = cli.database_url.as_deref().filter(|u| !u.is_empty());
    let service_url = url.filter(|_| flag_url);
    match &cli.command {
        Command::Migrate(args) => serve::migrate(args, service_url).await.map(|()| None),
        #[cfg(feature = "lab")]
        Command::Race(args) => race::run(args, url).await.map(Some),
        #[cfg(feature = "lab")]
        Command::Bench(args) => bench::run(args, url).await.map(Some),
        #[cfg(feature = "lab")]
        Command::Demo(args) => demo::run(args, url).await.map(Some),
        #[cfg(feature = "lab")]
        Command::Chaos(args) => chaos::run(args, url).await.map(Some),
        Command::Serve(args) => serve::serve(args, service_url, stop).await.map(|()| None),
        Command::Worker(args) => serve::worker(args, service_url, stop).await.map(|()| None),
        Command::Rollout(args) => serve::rollout(args, service_url).await.map(|()| None),
    }
}
