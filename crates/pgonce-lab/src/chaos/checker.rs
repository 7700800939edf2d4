//! The checker: written apart from the code under test, it knows only the
//! invariants. It reads a round's history and, with its own SQL, the
//! round's rows, and reports every violation it finds. For I1 it asks the
//! guard scenario's history check (`scenario::guard::overlaps`),
//! which knows the scenario's table and nothing of the guard; for I2 the
//! sequence scenario's per-scope check
//! (`scenario::sequence::numbers`), which knows the numbered table
//! and nothing of the strategies.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::Value;

use super::ScenarioKind;
use super::faults::FaultKind;
use super::history::{Entry, ErrorKind, Outcome};
use super::round::Round;
use super::schedule::Action;

/// One invariant broken in one round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// The invariant broken, as one of the constants below names it.
    pub invariant: &'static str,
    pub(crate) detail: String,
}

/// The guarded write's invariant, as a [`Violation`] names it.
pub const I1: &str = "I1 one OPEN incident per singleton entity";
/// The scoped sequence's invariant, as a [`Violation`] names it.
pub const I2: &str = "I2 numbers 1..n per scope";
/// The jobs' invariant, as a [`Violation`] names it.
pub const I3: &str = "I3 a job's side effect exactly once";
pub(crate) const I4: &str = "I4 a key's side effect once, one response";
/// The event store's conditional-append invariant, as a [`Violation`]
/// names it.
pub const I5: &str = "I5 no conditional append above an event its condition forbids";
/// The queue's invariant, as a [`Violation`] names it.
pub const I6: &str = "I6 queue: no loss, fenced receipts, FIFO";
pub(crate) const PIPELINE: &str = "the incident pipeline drains and settles";
pub(crate) const ATOMIC: &str = "a failed operation writes nothing";
pub(crate) const TYPED: &str = "an exhausted pool fails with a typed error";

fn violation(invariant: &'static str, detail: impl Into<String>) -> Violation {
    Violation {
        invariant,
        detail: detail.into(),
    }
}

/// Every violation of round `round` of `scenario`.
pub(crate) async fn check(scenario: ScenarioKind, round: &Round) -> anyhow::Result<Vec<Violation>> {
    let mut found = Vec::new();
    let entries = round.history.entries();
    atomic(round, entries, &mut found).await?;
    typed_exhaustion(entries, &mut found);
    match scenario {
        ScenarioKind::Guard => guard(round, &mut found).await?,
        ScenarioKind::Sequence => sequence(round, entries, &mut found).await?,
        ScenarioKind::Jobs => jobs(round, entries, &mut found).await?,
        ScenarioKind::Idempotency => keys(round, entries, &mut found).await?,
        ScenarioKind::Queue => queue(round, entries, &mut found).await?,
        ScenarioKind::Events => events(round, entries, &mut found).await?,
        ScenarioKind::Pipeline => pipeline(entries, &mut found),
    }
    Ok(found)
}

/// An operation that did not succeed left no row carrying its op id.
async fn atomic(
    round: &Round,
    entries: &[Entry],
    found: &mut Vec<Violation>,
) -> anyhow::Result<()> {
    let written: BTreeSet<i64> = sqlx::query_scalar(include_str!("sql/written_ops.sql"))
        .bind(&round.scope)
        .fetch_all(round.control())
        .await?
        .into_iter()
        .collect();
    for e in entries {
        if !e.outcome.is_ok() && written.contains(&e.op) {
            found.push(violation(
                ATOMIC,
                format!(
                    "op {} ({:?} of task {}) ended {:?} yet its row is committed",
                    e.op, e.action, e.task, e.outcome
                ),
            ));
        }
    }
    Ok(())
}

/// After a pool-exhaustion fault on a task, its next operation fails with
/// the pool's timeout, not with something else and not by succeeding.
fn typed_exhaustion(entries: &[Entry], found: &mut Vec<Violation>) {
    for (i, e) in entries.iter().enumerate() {
        let held = matches!(
            e.action,
            Action::Fault {
                fault: FaultKind::PoolExhaustion,
                ..
            }
        ) && e.outcome.is_ok();
        if !held {
            continue;
        }
        let next = entries[i + 1..]
            .iter()
            .find(|n| n.task == e.task && !n.action.is_fault() && n.outcome != Outcome::Skipped);
        if let Some(n) = next
            && n.outcome.error_kind() != Some(ErrorKind::PoolTimeout)
        {
            found.push(violation(
                TYPED,
                format!(
                    "op {} ({:?}) on an exhausted pool ended {:?}",
                    n.op, n.action, n.outcome
                ),
            ));
        }
    }
}

async fn guard(round: &Round, found: &mut Vec<Violation>) -> anyhow::Result<()> {
    for r in crate::scenario::guard::overlaps(round.control(), &round.scope).await? {
        found.push(violation(
            I1,
            format!(
                "incidents {} (op {}) and {} (op {}) of {} were OPEN at the same moment",
                r.first, r.first_op, r.second, r.second_op, r.entity
            ),
        ));
    }
    Ok(())
}

async fn sequence(
    round: &Round,
    entries: &[Entry],
    found: &mut Vec<Violation>,
) -> anyhow::Result<()> {
    let scopes = std::slice::from_ref(&round.scope);
    let in_table = crate::scenario::sequence::numbers(round.control(), scopes)
        .await?
        .pop();
    if let Some(c) = &in_table
        && !c.held()
    {
        found.push(violation(
            I2,
            format!(
                "committed numbers {:?}: {} missing or below 1, {} stored twice",
                c.numbers,
                c.gaps(),
                c.duplicates()
            ),
        ));
    }
    // A declaration refused because its number was taken: two
    // declarations computed one number.
    for e in entries {
        if e.action == Action::Number && e.outcome.error_kind() == Some(ErrorKind::NumberTaken) {
            found.push(violation(
                I2,
                format!(
                    "op {} of task {}: two declarations computed one number ({:?})",
                    e.op, e.task, e.outcome
                ),
            ));
        }
    }
    // Each declaration whose number and commit succeeded has its row.
    let mut numbered: BTreeMap<usize, i64> = BTreeMap::new();
    let mut committed = BTreeSet::new();
    for e in entries {
        match e.action {
            Action::Number if e.outcome.is_ok() => {
                numbered.insert(e.task, e.op);
            }
            Action::Begin | Action::Rollback => {
                numbered.remove(&e.task);
            }
            Action::Commit => {
                if let Some(op) = numbered.remove(&e.task)
                    && e.outcome.is_ok()
                {
                    committed.insert(op);
                }
            }
            _ => {}
        }
    }
    let stored: BTreeSet<i64> = in_table
        .iter()
        .flat_map(|c| c.ops.iter().copied())
        .collect();
    for op in committed.difference(&stored) {
        found.push(violation(
            I2,
            format!("the declaration numbered by op {op} committed, but its row is missing"),
        ));
    }
    for op in stored.difference(&committed) {
        found.push(violation(
            I2,
            format!("op {op}'s row is committed, but its declaration never committed"),
        ));
    }
    Ok(())
}

/// A job of the round: by its row, or by a side effect naming it.
#[derive(sqlx::FromRow)]
struct JobRow {
    id: i64,
    /// `None`: the job has no row.
    status: Option<String>,
    effects: i64,
}

/// Every job the history says was enqueued ends completed, its side
/// effect recorded once. Read from the history first: a job whose row is
/// gone is in no query of the jobs table, and would otherwise pass unseen.
async fn jobs(round: &Round, entries: &[Entry], found: &mut Vec<Violation>) -> anyhow::Result<()> {
    let rows: BTreeMap<i64, JobRow> = sqlx::query_as(include_str!("sql/check_jobs.sql"))
        .bind(&round.scope)
        .fetch_all(round.control())
        .await?
        .into_iter()
        .map(|r: JobRow| (r.id, r))
        .collect();
    for e in entries {
        let Action::Enqueue { .. } = e.action else {
            continue;
        };
        let Some(id) = e.outcome.value().and_then(Value::as_i64) else {
            continue;
        };
        let effects = rows.get(&id).map_or(0, |r| r.effects);
        if rows.get(&id).is_none_or(|r| r.status.is_none()) {
            found.push(violation(
                I3,
                format!(
                    "job {id}, enqueued by op {}, has no row after the drain (its side effect ran {effects} times): lost",
                    e.op
                ),
            ));
        }
    }
    for r in rows.values() {
        if let Some(status) = &r.status
            && status != "completed"
        {
            found.push(violation(
                I3,
                format!("job {} is {status} after the drain: lost", r.id),
            ));
        }
        if r.effects != 1 {
            found.push(violation(
                I3,
                format!("job {}'s side effect ran {} times", r.id, r.effects),
            ));
        }
    }
    Ok(())
}

#[derive(sqlx::FromRow)]
struct KeyRow {
    key: String,
    status: String,
    response: Option<Value>,
    effect_ops: Vec<i64>,
}

async fn keys(round: &Round, entries: &[Entry], found: &mut Vec<Violation>) -> anyhow::Result<()> {
    let rows: Vec<KeyRow> = sqlx::query_as(include_str!("sql/check_keys.sql"))
        .bind(&round.scope)
        .fetch_all(round.control())
        .await?;
    let mut effect_of: BTreeMap<String, i64> = BTreeMap::new();
    for r in &rows {
        if r.status != "done" {
            found.push(violation(
                I4,
                format!("key {} is {} after the drain", r.key, r.status),
            ));
        }
        if r.effect_ops.len() != 1 {
            found.push(violation(
                I4,
                format!(
                    "key {}'s side effect ran {} times (ops {:?})",
                    r.key,
                    r.effect_ops.len(),
                    r.effect_ops
                ),
            ));
            continue;
        }
        let op = r.effect_ops[0];
        effect_of.insert(r.key.clone(), op);
        let stored = r
            .response
            .as_ref()
            .and_then(|v| v.get("op"))
            .and_then(Value::as_i64);
        if stored != Some(op) {
            found.push(violation(
                I4,
                format!(
                    "key {} stores the response of op {stored:?}, its effect is op {op}",
                    r.key
                ),
            ));
        }
    }
    for e in entries {
        let Some(key) = e.input.get("key").and_then(Value::as_str) else {
            continue;
        };
        if !matches!(e.action, Action::Acquire { .. }) {
            continue;
        }
        if !effect_of.contains_key(key) && !rows.iter().any(|r| r.key == key) {
            found.push(violation(
                I4,
                format!("key {key} was used but has no row: lost"),
            ));
        }
        let replayed = e
            .outcome
            .value()
            .and_then(|v| v.get("replay"))
            .and_then(|r| r.get("op"))
            .and_then(Value::as_i64);
        if let (Some(replayed), Some(effect)) = (replayed, effect_of.get(key))
            && replayed != *effect
        {
            found.push(violation(I4, format!("op {} replayed the response of op {replayed} for key {key}, whose effect is op {effect}", e.op)));
        }
    }
    Ok(())
}

/// `g<group>-m<seq>` back to (group, seq).
fn parse_body(body: &str) -> Option<(u64, u64)> {
    let (g, m) = body.strip_prefix('g')?.split_once("-m")?;
    Some((g.parse().ok()?, m.parse().ok()?))
}

fn text<'a>(v: &'a Value, field: &str) -> Option<&'a str> {
    v.get(field).and_then(Value::as_str)
}

async fn queue(round: &Round, entries: &[Entry], found: &mut Vec<Violation>) -> anyhow::Result<()> {
    let mut sent: BTreeMap<(u64, u64), String> = BTreeMap::new();
    let mut id_of_receipt: BTreeMap<String, String> = BTreeMap::new();
    let mut latest: BTreeMap<String, String> = BTreeMap::new();
    let mut in_flight: BTreeSet<String> = BTreeSet::new();
    let mut deleted: BTreeSet<String> = BTreeSet::new();
    for e in entries {
        match e.action {
            Action::Send { .. }
            | Action::Fault {
                fault: FaultKind::DuplicateSend,
                ..
            } => {
                let (Some(body), Some(value)) = (text(&e.input, "body"), e.outcome.value()) else {
                    continue;
                };
                let Some(key) = parse_body(body) else {
                    continue;
                };
                let id = text(value, "id").unwrap_or_default().to_owned();
                let duplicate = value
                    .get("duplicate")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                match sent.get(&key) {
                    Some(first) if *first != id || !duplicate => found.push(violation(
                        I6,
                        format!("op {}: {body} sent again with its deduplication id made message {id} (duplicate: {duplicate}); the first is {first}", e.op),
                    )),
                    Some(_) => {}
                    None => {
                        sent.insert(key, id);
                    }
                }
            }
            Action::Receive => {
                let Some(messages) = e.outcome.value().and_then(Value::as_array) else {
                    continue;
                };
                for m in messages {
                    let (Some(id), Some(body), Some(receipt)) =
                        (text(m, "id"), text(m, "body"), text(m, "receipt"))
                    else {
                        continue;
                    };
                    if deleted.contains(id) {
                        found.push(violation(
                            I6,
                            format!(
                                "op {}: message {id} ({body}) delivered after it was deleted",
                                e.op
                            ),
                        ));
                    }
                    if in_flight.contains(id) {
                        found.push(violation(
                            I6,
                            format!(
                                "op {}: message {id} ({body}) delivered while still in flight",
                                e.op
                            ),
                        ));
                    }
                    if let Some((group, seq)) = parse_body(body) {
                        for earlier in 0..seq {
                            if let Some(before) = sent.get(&(group, earlier))
                                && !deleted.contains(before)
                            {
                                found.push(violation(I6, format!("op {}: {body} delivered before g{group}-m{earlier} was deleted (FIFO, one in flight per group)", e.op)));
                            }
                        }
                    }
                    id_of_receipt.insert(receipt.to_owned(), id.to_owned());
                    latest.insert(id.to_owned(), receipt.to_owned());
                    in_flight.insert(id.to_owned());
                }
            }
            Action::Fault {
                fault: FaultKind::Expiry,
                ..
            } => {
                if e.outcome.is_ok()
                    && let Some(id) = text(&e.input, "id")
                {
                    in_flight.remove(id);
                }
            }
            Action::Ack
            | Action::Fault {
                fault: FaultKind::StaleAck,
                ..
            } => {
                let Some(receipt) = text(&e.input, "receipt") else {
                    continue;
                };
                let Some(id) = id_of_receipt.get(receipt).cloned() else {
                    continue;
                };
                let current =
                    latest.get(&id).map(String::as_str) == Some(receipt) && !deleted.contains(&id);
                match &e.outcome {
                    Outcome::Ok { .. } => {
                        if !current {
                            found.push(violation(I6, format!("op {}: receipt {receipt} of an earlier delivery of message {id} was accepted", e.op)));
                        }
                        deleted.insert(id.clone());
                        in_flight.remove(&id);
                    }
                    Outcome::Err {
                        kind: ErrorKind::StaleReceipt,
                        ..
                    } if current => {
                        found.push(violation(
                            I6,
                            format!(
                                "op {}: the current receipt {receipt} of message {id} was refused",
                                e.op
                            ),
                        ));
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    for ((group, seq), id) in &sent {
        if !deleted.contains(id) {
            found.push(violation(
                I6,
                format!("message {id} (g{group}-m{seq}) was sent but never deleted: lost"),
            ));
        }
    }
    let left: i64 = sqlx::query_scalar(include_str!("sql/check_queue_left.sql"))
        .bind(super::queue::queue_name(&round.scope))
        .fetch_one(round.control())
        .await?;
    if left != 0 {
        found.push(violation(
            I6,
            format!("{left} messages left in the queue after the drain"),
        ));
    }
    Ok(())
}

async fn events(
    round: &Round,
    entries: &[Entry],
    found: &mut Vec<Violation>,
) -> anyhow::Result<()> {
    let tag = vec![super::events::claim_tag(&round.scope)];
    for e in entries {
        if e.action != Action::Append {
            continue;
        }
        let Some(position) = e
            .outcome
            .value()
            .and_then(|v| v.get("positions"))
            .and_then(|p| p.get(0))
            .and_then(Value::as_i64)
        else {
            continue;
        };
        let after = e.input.get("after").and_then(Value::as_i64).unwrap_or(0);
        let forbidden: Vec<i64> = sqlx::query_scalar(include_str!("sql/check_events.sql"))
            .bind(super::events::CLAIM)
            .bind(&tag)
            .bind(position)
            .fetch_all(round.control())
            .await?;
        if !forbidden.is_empty() {
            found.push(violation(
                I5,
                format!("op {} appended at {position} on a decision that saw no claim up to {after}, above claims {forbidden:?}", e.op),
            ));
        }
    }
    Ok(())
}

/// The incident run checks its invariants in the database with the
/// service's own audit queries (`pgonce_incidents::invariants`), over
/// history (I1 at every moment, not only at the end); this reads their
/// verdicts from the history.
fn pipeline(entries: &[Entry], found: &mut Vec<Violation>) {
    for e in entries {
        if !matches!(e.action, Action::Pipeline { .. }) {
            continue;
        }
        let Some(v) = e.outcome.value() else {
            found.push(violation(
                PIPELINE,
                format!("the incident run failed: {:?}", e.outcome),
            ));
            continue;
        };
        let detail = text(v, "detail").unwrap_or_default();
        for (field, invariant) in [("i1", I1), ("i2", I2), ("i3", I3), ("i6", I6)] {
            if v.get(field).and_then(Value::as_bool) != Some(true) {
                found.push(violation(
                    invariant,
                    format!("the incident run broke {field}: {detail}"),
                ));
            }
        }
        for field in ["drained", "settled"] {
            if v.get(field).and_then(Value::as_bool) != Some(true) {
                found.push(violation(
                    PIPELINE,
                    format!("the incident run was not {field} in time"),
                ));
            }
        }
    }
}
