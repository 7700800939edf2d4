//! The faults a round can inject, chosen by the seeded schedule. The
//! generic ones (a terminated backend, a restarted server, an exhausted
//! pool) are injected here; the ones that need a scenario's state (an
//! expiry while a handler runs, a duplicate send, a late ack with a stale
//! receipt) by the scenario, through [`super::round::Round`].

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::history::Outcome;
use super::round::Round;

/// A kind of fault (`--faults` takes a comma list of these names).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// `pg_terminate_backend` of the task's connection.
    Terminate,
    /// `pg_ctl restart -m fast` (only on the run's own throwaway cluster).
    Restart,
    /// Every connection of the task's pool held, so its next operation
    /// must fail with a typed error and write nothing.
    PoolExhaustion,
    /// A visibility timeout, lease or key hold runs out while its handler
    /// is still busy (forced from another connection, not waited for).
    Expiry,
    /// A message sent again with its deduplication id.
    DuplicateSend,
    /// A late ack with an earlier delivery's receipt.
    StaleAck,
    /// The pipeline's webhook receiver fails some requests and answers
    /// others after the sender's timeout.
    Webhook,
    /// SIGKILL of a child `pgonce worker` process while it works the
    /// pipeline's queue: no ack, no heartbeat, no completion. Only the
    /// `pgonce` command can start such a child (it runs itself); elsewhere
    /// the fault is not injected and not counted.
    WorkerKill,
}

impl FaultKind {
    pub(crate) const ALL: [FaultKind; 8] = [
        FaultKind::Terminate,
        FaultKind::Restart,
        FaultKind::PoolExhaustion,
        FaultKind::Expiry,
        FaultKind::DuplicateSend,
        FaultKind::StaleAck,
        FaultKind::Webhook,
        FaultKind::WorkerKill,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            FaultKind::Terminate => "terminate",
            FaultKind::Restart => "restart",
            FaultKind::PoolExhaustion => "pool-exhaustion",
            FaultKind::Expiry => "expiry",
            FaultKind::DuplicateSend => "duplicate-send",
            FaultKind::StaleAck => "stale-ack",
            FaultKind::Webhook => "webhook",
            FaultKind::WorkerKill => "worker-kill",
        }
    }

    /// The faults every scenario can take.
    pub(crate) const GENERIC: [FaultKind; 3] = [
        FaultKind::Terminate,
        FaultKind::Restart,
        FaultKind::PoolExhaustion,
    ];
}

/// Injects a generic fault aimed at `task`; returns `false` for a
/// scenario-specific kind, which the scenario injects itself.
pub(crate) async fn inject_generic(
    round: &mut Round,
    task: usize,
    fault: FaultKind,
    target: usize,
) -> bool {
    let action = super::schedule::Action::Fault { fault, target };
    match fault {
        FaultKind::Terminate => {
            let ended = sqlx::query_scalar::<_, i64>(include_str!("sql/terminate.sql"))
                .bind(round.session_name(task))
                .fetch_one(round.control())
                .await;
            let outcome = match ended {
                Ok(n) => {
                    round.stats.fault(fault);
                    Outcome::ok(serde_json::json!({ "terminated": n }))
                }
                Err(e) => Outcome::Err {
                    kind: super::history::ErrorKind::of_sqlx(&e),
                    message: e.to_string(),
                },
            };
            round
                .history
                .record(task, action, serde_json::Value::Null, outcome);
        }
        FaultKind::Restart => {
            let Some(restart) = round.restarters.pop() else {
                round
                    .history
                    .record(task, action, serde_json::Value::Null, Outcome::Skipped);
                return true;
            };
            let started = Instant::now();
            let done = tokio::task::spawn_blocking(restart)
                .await
                .map_err(anyhow::Error::from)
                .and_then(|r| r);
            let outcome = match done {
                Ok(()) => {
                    round.stats.fault(fault);
                    round.recovering = Some(started);
                    Outcome::ok(
                        serde_json::json!({ "ready_ms": started.elapsed().as_millis() as u64 }),
                    )
                }
                Err(e) => Outcome::Err {
                    kind: super::history::ErrorKind::Other,
                    message: format!("{e:#}"),
                },
            };
            round
                .history
                .record(task, action, serde_json::Value::Null, outcome);
        }
        FaultKind::PoolExhaustion => {
            // The pool has one connection: take it if it is idle. When the
            // task's open transaction holds it, the pool is exhausted
            // already, by the task itself.
            let held = round.session(task).try_acquire();
            let outcome = match held {
                Some(conn) => {
                    round.stats.fault(fault);
                    round.exhausted[task] = Some(conn);
                    Outcome::ok("held")
                }
                None => Outcome::Skipped,
            };
            round
                .history
                .record(task, action, serde_json::Value::Null, outcome);
        }
        _ => return false,
    }
    true
}
