//! The incident service run under faults with every pool going through
//! PgBouncer in `pool_mode = transaction` (the pipeline's workers, the
//! people's calls, the notifier, the reaper and re-driver, the run's own
//! checks) and LISTEN over a direct connection: no error of any kind
//! caused by the pooler, and every invariant holds. Also: `pgonce demo
//! --pooler` starts its own PgBouncer and runs through it.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use pgonce::{Listen, PoolerProblem};
use pgonce_lab::demo;
use pgonce_lab::incident_run::{self, IncidentRunConfig};
use pgonce_testkit::fresh_database_behind_pooler;
use sqlx::postgres::PgPoolOptions;
use tracing_subscriber::fmt::MakeWriter;

/// Every warning and error logged in this test process, one per line.
/// Process-wide: only one test of this file may look at it, or it would
/// see the other's lines.
#[derive(Clone, Default)]
struct Logged(Arc<Mutex<Vec<u8>>>);

impl Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Logged {
    type Writer = Logged;
    fn make_writer(&'a self) -> Logged {
        self.clone()
    }
}

impl Logged {
    /// Starts collecting (once per process) and returns the collector.
    fn collect() -> Logged {
        static LOGGED: OnceLock<Logged> = OnceLock::new();
        LOGGED
            .get_or_init(|| {
                let logged = Logged::default();
                tracing_subscriber::fmt()
                    .with_max_level(tracing::Level::WARN)
                    .with_ansi(false)
                    .with_writer(logged.clone())
                    .init();
                logged
            })
            .clone()
    }

    /// The logged lines that show a pooler problem: a typed pooler error, a
    /// prepared statement that moved, a notification on a pooled
    /// connection, any other protocol error.
    fn pooler_problems(&self) -> Vec<String> {
        const SIGNS: [&str; 5] = [
            "connection pooler",
            "prepared statement",
            "NotificationResponse",
            "protocol",
            "unexpected message",
        ];
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines()
            .filter(|l| SIGNS.iter().any(|s| l.contains(s)))
            .map(str::to_owned)
            .collect()
    }
}

#[tokio::test]
async fn the_incident_run_through_pgbouncer_in_transaction_mode_keeps_every_invariant() {
    let logged = Logged::collect();
    let (db, through_pooler) = fresh_database_behind_pooler().await;
    let pool = PgPoolOptions::new()
        .max_connections(30)
        .connect_with(through_pooler)
        .await
        .unwrap();
    let mut config = IncidentRunConfig::quick();
    config.listen = Listen::Direct(Box::new(db.options()));
    let outcome = incident_run::run(&pool, &config, None, None).await.unwrap();
    assert!(outcome.drained && outcome.settled, "{outcome:#?}");
    assert!(outcome.all_hold(), "{outcome:#?}");
    assert!(outcome.tallies.incidents > 0);
    assert_eq!(outcome.tallies.notifications, outcome.tallies.incidents);
    assert!(outcome.workers.received > 0 && outcome.human_actions > 0);
    // No database call of the run's drivers failed, even transiently.
    assert_eq!(outcome.driver_retries, 0, "{outcome:#?}");
    let problems = logged.pooler_problems();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// `pgonce demo --pooler`: the demo starts a PgBouncer in front of the
/// server, runs through it with LISTEN direct, stops it, and says so in
/// its report.
#[tokio::test]
async fn the_demo_runs_behind_a_pgbouncer_it_starts_itself() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        demo: demo::DemoArgs,
    }
    let server = pgonce_testkit::shared_for_tests().unwrap();
    let url = match std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => url,
        None => {
            let o = server.options();
            format!(
                "postgres://{}@{}:{}/postgres",
                o.get_username(),
                o.get_host(),
                o.get_port()
            )
        }
    };
    let cli = Cli::parse_from([
        "demo",
        "--pooler",
        "--observations",
        "60",
        "--organizations",
        "1",
        "--entities",
        "5",
        "--deadline-secs",
        "60",
    ]);
    let report = demo::run(&cli.demo, Some(&url)).await.unwrap();
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["verdict"]["ok"], true, "{json:#}");
    let connections = report
        .results
        .iter()
        .find(|r| r.text("figure").as_deref() == Some("connections"))
        .and_then(|r| r.text("value"));
    assert_eq!(
        connections.as_deref(),
        Some("through PgBouncer (transaction mode); LISTEN on a direct connection")
    );
}

/// The run's drivers wait out a pooler that cannot reach the server (it is
/// restarting) or has no room for another client, and give up at once on
/// a pooler set up wrongly.
#[test]
fn a_pooler_waiting_for_the_server_is_transient_and_a_misconfigured_one_is_not() {
    let pooler = |problem| {
        anyhow::Error::new(pgonce::Error::Pooler {
            problem,
            message: "from the pooler".into(),
        })
        .context("a driver's call")
    };
    assert!(incident_run::is_transient(&pooler(
        PoolerProblem::ServerUnreachable
    )));
    assert!(incident_run::is_transient(&pooler(
        PoolerProblem::ClientLimit
    )));
    assert!(!incident_run::is_transient(&pooler(
        PoolerProblem::PreparedStatements
    )));
    assert!(!incident_run::is_transient(&pooler(
        PoolerProblem::Notifications
    )));
}
