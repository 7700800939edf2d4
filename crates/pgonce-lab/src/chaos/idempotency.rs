//! Scenario `idempotency` (I4): three tasks handle requests that carry one
//! of two idempotency keys: acquire the key, then write the handler's side
//! effect and the response in one transaction. A hold can run out while
//! its request is still being processed, and another request then takes
//! the key over. At the end a drain finishes every key. Each key's side
//! effect must exist once, and every replay must return the response of
//! the request whose effect it is.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::rngs::StdRng;
use serde_json::json;

use pgonce::dedupe::{self, Acquired, KeyHold};

use super::faults::{self, FaultKind};
use super::history::Outcome;
use super::round::Round;
use super::schedule::{Action, Step, takes_then_releases};

pub(crate) const TASKS: usize = 3;
const KEYS: usize = 2;
/// Long enough never to run out by itself: holds expire only by fault.
const HOLD: Duration = Duration::from_secs(300);

pub(crate) fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
    takes_then_releases(rng, faults, TASKS, KEYS, |key| {
        [Action::Acquire { key }, Action::Finish { key }]
    })
}

fn key_name(key: usize) -> String {
    format!("k{}", key % KEYS)
}

pub(crate) async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    let mut holds: Vec<BTreeMap<usize, KeyHold>> = vec![BTreeMap::new(); round.tasks()];
    for step in steps {
        let task = step.task;
        let pool = round.session(task).clone();
        match step.action {
            Action::Fault {
                fault: FaultKind::Expiry,
                target,
            } => {
                let expired = expire(round, &key_name(target)).await;
                round.stats.fault(FaultKind::Expiry);
                round.history.record(
                    task,
                    step.action,
                    json!({ "key": key_name(target) }),
                    expired,
                );
            }
            Action::Fault { fault, target } => {
                faults::inject_generic(round, task, fault, target).await;
            }
            Action::Acquire { key } => {
                if let Some(hold) = acquire(round, &pool, task, step.action, key).await {
                    holds[task].insert(key % KEYS, hold);
                }
            }
            Action::Finish { key } => {
                let Some(hold) = holds[task].remove(&(key % KEYS)) else {
                    round.history.skip(task, step.action);
                    continue;
                };
                let op = round
                    .history
                    .invoke(task, step.action, json!({ "key": hold.key }));
                let done = handle(&pool, &round.scope, &hold, op).await;
                round.history.finish(op, &done);
                round.after_operation(task, done.is_ok());
            }
            _ => {
                round.history.skip(task, step.action);
            }
        }
    }
    // The drain: every key's request retried until it has its response.
    let drain = round.tasks();
    let control = round.control().clone();
    for key in 0..KEYS {
        for _ in 0..3 {
            let action = Action::Acquire { key };
            let Some(hold) = acquire(round, &control, drain, action, key).await else {
                let response = round.history.entries().last().map(|e| e.outcome.clone());
                if response.is_some_and(|o| o.is_ok()) {
                    break; // a replay: the key is done
                }
                expire(round, &key_name(key)).await;
                continue;
            };
            let op =
                round
                    .history
                    .invoke(drain, Action::Finish { key }, json!({ "key": hold.key }));
            let done = handle(&control, &round.scope, &hold, op).await;
            round.history.finish(op, &done);
            if done.is_ok() {
                break;
            }
        }
    }
    Ok(())
}

/// Acquires `key` for `task`; records a replay's response.
async fn acquire(
    round: &mut Round,
    pool: &sqlx::PgPool,
    task: usize,
    action: Action,
    key: usize,
) -> Option<KeyHold> {
    let name = key_name(key);
    let op = round.history.invoke(task, action, json!({ "key": name }));
    let fingerprint = dedupe::fingerprint(&json!({ "key": name })).ok()?;
    let acquired = dedupe::acquire(pool, &round.scope, &name, &fingerprint, HOLD).await;
    let outcome = match &acquired {
        Ok(Acquired::Process(_)) => Outcome::ok(json!({ "process": true })),
        Ok(Acquired::Replay(response)) => Outcome::ok(json!({ "replay": response })),
        Err(e) => Outcome::error(e),
    };
    let ok = outcome.is_ok();
    round.history.complete(op, outcome);
    if task < round.tasks() {
        round.after_operation(task, ok);
    }
    match acquired {
        Ok(Acquired::Process(hold)) => Some(hold),
        _ => None,
    }
}

/// The handler: its side effect and the stored response, in one
/// transaction.
async fn handle(pool: &sqlx::PgPool, scope: &str, hold: &KeyHold, op: i64) -> pgonce::Result<()> {
    let mut tx = pgonce::begin(pool, pgonce::IsolationLevel::ReadCommitted).await?;
    sqlx::query(include_str!("sql/key_effect.sql"))
        .bind(scope)
        .bind(&hold.key)
        .bind(op)
        .execute(&mut *tx)
        .await?;
    dedupe::finish(&mut *tx, hold, &json!({ "op": op })).await?;
    tx.commit().await?;
    Ok(())
}

/// Runs the hold on `key` out, as if its request had stalled.
async fn expire(round: &Round, key: &str) -> Outcome {
    let expired = sqlx::query(include_str!("sql/key_expire.sql"))
        .bind(&round.scope)
        .bind(key)
        .execute(round.control())
        .await;
    match expired {
        Ok(r) => Outcome::ok(json!({ "expired": r.rows_affected() })),
        Err(e) => Outcome::sqlx(&e),
    }
}
