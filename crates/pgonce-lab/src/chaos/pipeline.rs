//! Scenario `pipeline` (I1, I2, I3, I6 together): the whole incident
//! service at a small size, through [`crate::incident_run`], the run
//! `pgonce demo` renders: observations on the FIFO queue with duplicate
//! sends, a visibility timeout shorter than the slow evaluations, people
//! declaring and resolving, one worker runtime killed part-way (its tasks
//! aborted mid-message) and replaced, a webhook receiver that fails and
//! answers late, and (with the `restart` fault, on the run's own cluster)
//! the server restarted mid-run. Heavy: the rotation runs it once every
//! [`EVERY`] rounds.

use std::time::Duration;

use anyhow::Context;
use rand::Rng;
use rand::rngs::StdRng;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;

use pgonce_testkit::webhook::ReceiverFaults;

use super::faults::FaultKind;
use super::history::Outcome;
use super::round::Round;
use super::schedule::{Action, Step};
use crate::incident_run::{self, IncidentRunConfig};

pub(crate) const TASKS: usize = 1;
/// One round in this many is the pipeline's, when it is selected with
/// others (`pgonce chaos --help` and the README say 25).
pub(crate) const EVERY: u64 = 25;

pub(crate) fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
    let mut steps = Vec::new();
    if faults.contains(&FaultKind::Restart) && rng.random_bool(0.5) {
        steps.push(Step {
            task: 0,
            action: Action::Fault {
                fault: FaultKind::Restart,
                target: 0,
            },
        });
    }
    steps.push(Step {
        task: 0,
        action: Action::Pipeline {
            observations: rng.random_range(40..=80),
            webhook_faults: faults.contains(&FaultKind::Webhook),
            restart_after_ms: rng.random_range(200..=1500),
            worker_kill_after_ms: faults
                .contains(&FaultKind::WorkerKill)
                .then(|| rng.random_range(300..=2500)),
        },
    });
    steps
}

pub(crate) async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    let restart_wanted = steps.iter().any(|s| {
        matches!(
            s.action,
            Action::Fault {
                fault: FaultKind::Restart,
                ..
            }
        )
    });
    for step in steps {
        let Action::Pipeline {
            observations,
            webhook_faults,
            restart_after_ms,
            worker_kill_after_ms,
        } = step.action
        else {
            continue;
        };
        let worker_kill = worker_kill_after_ms.zip(round.worker_program.clone());
        let mut config = IncidentRunConfig::quick();
        if worker_kill.is_some() {
            // `pgonce worker` takes whole seconds, and its queue settings
            // must be the run's: it creates the same queue on start.
            config = config.whole_second_visibility();
        }
        config.observations = observations as usize;
        config.receiver = if webhook_faults {
            round.stats.fault(FaultKind::Webhook);
            config.receiver
        } else {
            ReceiverFaults {
                fail_rate: 0.0,
                late_rate: 0.0,
                late_by: Duration::ZERO,
            }
        };
        let restart = match restart_wanted.then(|| round.restarters.pop()).flatten() {
            Some(restarter) => {
                round.stats.fault(FaultKind::Restart);
                Some((Duration::from_millis(restart_after_ms as u64), restarter))
            }
            None => None,
        };
        // The incident run wants an empty database: one of its own, on
        // the same server, dropped afterwards.
        let name = format!("pgonce_chaos_{}", round.scope.replace('-', "_"));
        let sql = |template: &str| sqlx::AssertSqlSafe(template.replace("{name}", &name));
        sqlx::raw_sql(sql(include_str!("sql/pipeline_create_database.sql")))
            .execute(round.control())
            .await?;
        let input = json!({
            "restart": restart.is_some(),
            "worker_kill": worker_kill.is_some(),
            "database": name,
        });
        let op = round.history.invoke(0, step.action, input);
        let options = round.options().clone().database(&name);
        let child = match worker_kill {
            Some((after_ms, program)) => Some(WorkerChild::start(
                &program,
                &options,
                &config,
                Duration::from_millis(after_ms as u64),
            )?),
            None => None,
        };
        let outcome = async {
            let pool = PgPoolOptions::new()
                .max_connections(30)
                .connect_with(options.clone())
                .await?;
            let outcome = incident_run::run(&pool, &config, restart, None).await;
            pool.close().await;
            outcome
        }
        .await;
        if let Some(child) = child
            && child.killed().await
        {
            round.stats.fault(FaultKind::WorkerKill);
        }
        sqlx::raw_sql(sql(include_str!("sql/pipeline_drop_database.sql")))
            .execute(round.control())
            .await?;
        let recorded = match outcome {
            Ok(o) => {
                if let Some(r) = &o.restart {
                    round.stats.recoveries.push(super::Recovery {
                        after: "restart",
                        millis: (r.took_secs * 1000.0) as u64,
                    });
                }
                Outcome::ok(json!({
                    "i1": o.invariants.i1(),
                    "i2": o.invariants.i2(),
                    "i3": o.invariants.i3() && o.notifications.holds() && o.deliveries.holds(),
                    "i6": o.invariants.i6() && o.observations.holds(),
                    "drained": o.drained,
                    "settled": o.settled,
                    "incidents": o.tallies.incidents,
                    "notifications": o.tallies.notifications,
                    "detail": format!("{:?}; {:?}", o.invariants, o.deliveries),
                }))
            }
            Err(e) => Outcome::Err {
                kind: super::history::ErrorKind::Other,
                message: format!("{e:#}"),
            },
        };
        round.history.complete(op, recorded);
    }
    Ok(())
}

/// A child `pgonce worker` process working the run's observations queue
/// beside the run's own runtimes, SIGKILLed after a while: the kill a
/// deployment sees when a machine dies, with the process's connections
/// cut by the kernel rather than closed.
struct WorkerChild {
    kill: tokio::task::JoinHandle<bool>,
}

impl WorkerChild {
    /// Starts `program worker` on the database `options` names, with the
    /// run's queue settings (the worker creates or updates the queue on
    /// start, so they must be the run's), and arms the kill.
    fn start(
        program: &std::path::Path,
        options: &sqlx::postgres::PgConnectOptions,
        config: &IncidentRunConfig,
        after: Duration,
    ) -> anyhow::Result<WorkerChild> {
        use sqlx::ConnectOptions;
        let visibility = format!("{}s", config.visibility.as_secs().max(1));
        let mut child = tokio::process::Command::new(program)
            .arg("worker")
            .env("PGONCE_DATABASE__URL", options.to_url_lossy().as_str())
            .env("PGONCE_PIPELINE__WORKERS", "1")
            .env("PGONCE_PIPELINE__CONCURRENCY", "4")
            .env("PGONCE_PIPELINE__VISIBILITY_TIMEOUT", visibility)
            .env(
                "PGONCE_PIPELINE__MAX_RECEIVE_COUNT",
                config.max_receive_count.to_string(),
            )
            .env("RUST_LOG", "error")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} worker", program.display()))?;
        let kill = tokio::spawn(async move {
            tokio::time::sleep(after).await;
            // Still running: the kill lands mid-work. Already exited (it
            // could not start): nothing was killed, and nothing counts.
            let alive = matches!(child.try_wait(), Ok(None));
            // `start_kill` sends SIGKILL on Unix.
            let killed = alive && child.start_kill().is_ok();
            let _ = child.wait().await;
            killed
        });
        Ok(WorkerChild { kill })
    }

    /// Waits for the kill; whether it landed on a running process.
    async fn killed(self) -> bool {
        self.kill.await.unwrap_or(false)
    }
}
