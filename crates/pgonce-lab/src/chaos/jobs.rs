//! Scenario `jobs` (I3): two jobs, three workers claiming and completing
//! them with leases, a lease that runs out while its worker is busy (then
//! the reaper returns the job), and at the end a drain that finishes every
//! job. Each job's side effect, recorded with its job id in the
//! transaction that completes it, must exist exactly once, and each job
//! enqueued must end completed: a job whose row is gone is lost.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::rngs::StdRng;
use serde_json::json;

use pgonce::job::{self, Lease, NewJob, ReapCounts, Reaper, ReaperConfig};

use super::Mutant;
use super::faults::{self, FaultKind};
use super::history::Outcome;
use super::round::Round;
use super::schedule::{Action, Step, takes_then_releases};

pub(crate) const TASKS: usize = 3;
const JOBS: usize = 2;
/// Long enough never to run out by itself: leases expire only by fault.
const LEASE: Duration = Duration::from_secs(300);

pub(crate) fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
    takes_then_releases(rng, faults, TASKS, JOBS, |job| {
        [Action::Claim { job }, Action::Complete { job }]
    })
}

pub(crate) async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    let mut ids = Vec::with_capacity(JOBS);
    let setup = round.tasks();
    for n in 0..JOBS {
        let new = NewJob::new(&round.scope, json!({ "n": n })).max_attempts(1000);
        let op = round
            .history
            .invoke(setup, Action::Enqueue { job: n }, json!({ "n": n }));
        let enqueued = job::enqueue(round.control(), &new).await;
        round.history.finish(op, &enqueued);
        ids.push(enqueued?);
    }
    let reaper = Reaper::new(round.control().clone(), ReaperConfig::default())?;
    let mut leases: Vec<BTreeMap<usize, Lease>> = vec![BTreeMap::new(); round.tasks()];
    for step in steps {
        let task = step.task;
        let pool = round.session(task).clone();
        match step.action {
            Action::Fault {
                fault: FaultKind::Expiry,
                target,
            } => {
                let expired = expire(round, &reaper, ids[target % JOBS]).await;
                round.stats.fault(FaultKind::Expiry);
                round.history.record(
                    task,
                    step.action,
                    json!({ "job": ids[target % JOBS] }),
                    expired,
                );
            }
            Action::Fault { fault, target } => {
                faults::inject_generic(round, task, fault, target).await;
            }
            Action::Claim { job } => {
                let id = ids[job % JOBS];
                let op = round
                    .history
                    .invoke(task, step.action, json!({ "job": id }));
                let claimed = job::claim(&pool, id, LEASE).await;
                round.history.finish(op, &claimed.as_ref().map(|l| l.token));
                round.after_operation(task, claimed.is_ok());
                if let Ok(lease) = claimed {
                    leases[task].insert(job % JOBS, lease);
                }
            }
            Action::Complete { job } => {
                let Some(lease) = leases[task].remove(&(job % JOBS)) else {
                    round.history.skip(task, step.action);
                    continue;
                };
                let op = round
                    .history
                    .invoke(task, step.action, json!({ "job": lease.job_id }));
                let done = work(&pool, &round.scope, &lease, op).await;
                round.history.finish(op, &done);
                round.after_operation(task, done.is_ok());
            }
            _ => {
                round.history.skip(task, step.action);
            }
        }
    }
    // The drain: what a surviving worker and the reaper do eventually.
    let drain = round.tasks();
    for &id in &ids {
        for _ in 0..3 {
            let op = round
                .history
                .invoke(drain, Action::Claim { job: 0 }, json!({ "job": id }));
            let claimed = job::claim(round.control(), id, LEASE).await;
            round.history.finish(op, &claimed.as_ref().map(|l| l.token));
            match claimed {
                Ok(lease) => {
                    let op = round.history.invoke(
                        drain,
                        Action::Complete { job: 0 },
                        json!({ "job": id }),
                    );
                    let done = work(round.control(), &round.scope, &lease, op).await;
                    round.history.finish(op, &done);
                    if done.is_ok() {
                        break;
                    }
                }
                Err(pgonce::Error::AlreadyHandled { .. }) => break,
                Err(_) => {
                    let _ = expire(round, &reaper, id).await;
                }
            }
        }
    }
    Ok(())
}

/// The side effect and the completion, in one transaction.
async fn work(pool: &sqlx::PgPool, scope: &str, lease: &Lease, op: i64) -> pgonce::Result<()> {
    let mut tx = pgonce::begin(pool, pgonce::IsolationLevel::ReadCommitted).await?;
    sqlx::query(include_str!("sql/job_effect.sql"))
        .bind(scope)
        .bind(lease.job_id)
        .bind(op)
        .execute(&mut *tx)
        .await?;
    job::complete(&mut *tx, lease, &json!({ "op": op })).await?;
    tx.commit().await?;
    Ok(())
}

/// Runs job `id`'s lease out and lets the reaper return it (under the
/// deleting-reaper mutant, delete it).
async fn expire(round: &Round, reaper: &Reaper, id: i64) -> Outcome {
    let expired = async {
        sqlx::query(include_str!("sql/job_expire.sql"))
            .bind(id)
            .execute(round.control())
            .await?;
        if round.mutant == Some(Mutant::JobsReaperDelete) {
            return deleting_reaper(round).await;
        }
        reaper.run_once().await
    }
    .await;
    match expired {
        Ok(counts) => Outcome::ok(json!({ "returned": counts.returned, "dead": counts.dead })),
        Err(e) => Outcome::error(&e),
    }
}

/// The mutant's reaper: deletes the round's jobs whose lease ran out, and
/// reports them returned, as a reaper that believes it did its job would.
async fn deleting_reaper(round: &Round) -> pgonce::Result<ReapCounts> {
    let deleted = sqlx::query(include_str!("sql/mutant_jobs_reap_delete.sql"))
        .bind(&round.scope)
        .execute(round.control())
        .await?;
    let mut counts = ReapCounts::default();
    counts.returned = deleted.rows_affected();
    Ok(counts)
}
