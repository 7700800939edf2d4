//! Scenario `queue` (I6): a FIFO queue with two message groups; a producer
//! sends, three consumers receive and delete by receipt. Faults: a
//! visibility timeout that runs out while a consumer still holds its
//! delivery (`change_visibility` to 0 from another connection), a message
//! sent again with its deduplication id, a late ack with an earlier
//! delivery's receipt. At the end a drain acks what is held and receives
//! what is left. Nothing may be lost, no stale receipt accepted, a group's
//! messages delivered in order and one at a time.

use std::time::Duration;

use rand::Rng;
use rand::rngs::StdRng;
use serde_json::{Value, json};

use pgonce::{
    PgQueue, PgQueueOptions, Queue, QueueAttributes, Receipt, ReceiveRequest, Received, SendMessage,
};

use super::Mutant;
use super::faults::{self, FaultKind};
use super::round::Round;
use super::schedule::{Action, Step, interleave, sprinkle_faults};

/// Task 0 sends; tasks 1 to 3 consume.
pub(crate) const TASKS: usize = 4;
const GROUPS: usize = 2;
const PER_GROUP: usize = 2;
/// Long enough never to run out by itself: deliveries expire only by fault.
const VISIBILITY: Duration = Duration::from_secs(300);

pub(crate) fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
    let mut programs = vec![Vec::new(); TASKS];
    for seq in 0..PER_GROUP {
        for group in 0..GROUPS {
            programs[0].push(Action::Send { group, seq });
        }
    }
    // A consumer's delivery may expire while it works (then another
    // consumer, or itself, receives the message again) and it may ack
    // late with an earlier receipt: both placed in the consumer's own
    // program, so they hit a delivery it holds.
    let expiry = faults.contains(&FaultKind::Expiry);
    let stale_ack = faults.contains(&FaultKind::StaleAck);
    let fault = |fault| Action::Fault { fault, target: 0 };
    for program in programs.iter_mut().skip(1) {
        for _ in 0..rng.random_range(1..=3) {
            program.push(Action::Receive);
            if expiry && rng.random_bool(0.4) {
                program.push(fault(FaultKind::Expiry));
            }
            program.push(Action::Ack);
            if stale_ack && rng.random_bool(0.3) {
                program.push(fault(FaultKind::StaleAck));
            }
        }
    }
    let mut steps = interleave(rng, programs);
    sprinkle_faults(
        rng,
        &mut steps,
        faults,
        &[FaultKind::DuplicateSend],
        TASKS,
        GROUPS,
        3,
    );
    steps
}

/// The body of message `seq` of `group`; also its deduplication id.
fn body(group: usize, seq: usize) -> String {
    format!("g{group}-m{seq}")
}

pub(crate) fn queue_name(scope: &str) -> String {
    format!("chaos-{scope}")
}

struct Consumer {
    handle: PgQueue,
    /// The delivery the consumer is working on.
    current: Option<Received>,
    /// Receipts of its earlier deliveries, for late acks.
    earlier: Vec<Receipt>,
}

pub(crate) async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    let name = queue_name(&round.scope);
    let attributes = QueueAttributes::fifo().visibility_timeout(VISIBILITY);
    let control = PgQueue::create(
        round.control(),
        &name,
        attributes,
        PgQueueOptions::default(),
    )
    .await?;
    let mut consumers = Vec::with_capacity(round.tasks());
    for task in 0..round.tasks() {
        consumers.push(Consumer {
            handle: PgQueue::open(round.session(task), &name, PgQueueOptions::default()).await?,
            current: None,
            earlier: Vec::new(),
        });
    }
    let mut last_sent: Vec<Option<usize>> = vec![None; GROUPS];
    for step in steps {
        let task = step.task;
        match step.action {
            Action::Fault {
                fault: FaultKind::Expiry,
                ..
            } => {
                let Some(delivery) = &consumers[task].current else {
                    round.history.skip(task, step.action);
                    continue;
                };
                let input = json!({ "id": delivery.id, "receipt": delivery.receipt.0 });
                let op = round.history.invoke(task, step.action, input);
                let hidden = control
                    .change_visibility(&delivery.receipt, Duration::ZERO)
                    .await;
                round.stats.fault(FaultKind::Expiry);
                round.history.finish(op, &hidden);
            }
            Action::Fault {
                fault: FaultKind::DuplicateSend,
                target,
            } => {
                let group = target % GROUPS;
                let Some(seq) = last_sent[group] else {
                    round.history.skip(task, step.action);
                    continue;
                };
                let message = SendMessage::new(body(group, seq))
                    .group(format!("g{group}"))
                    .dedup(body(group, seq));
                let op =
                    round
                        .history
                        .invoke(task, step.action, json!({ "body": body(group, seq) }));
                let sent = control.send(message).await;
                round.stats.fault(FaultKind::DuplicateSend);
                round.history.finish(
                    op,
                    &sent
                        .as_ref()
                        .map(|s| json!({ "id": s.id, "duplicate": s.duplicate })),
                );
            }
            Action::Fault {
                fault: FaultKind::StaleAck,
                ..
            } => {
                let Some(receipt) = consumers[task].earlier.last().cloned() else {
                    round.history.skip(task, step.action);
                    continue;
                };
                round.stats.fault(FaultKind::StaleAck);
                ack(round, &control, task, step.action, &receipt).await;
            }
            Action::Fault { fault, target } => {
                faults::inject_generic(round, task, fault, target).await;
            }
            Action::Send { group, seq } => {
                let message = SendMessage::new(body(group, seq))
                    .group(format!("g{group}"))
                    .dedup(body(group, seq));
                let op =
                    round
                        .history
                        .invoke(task, step.action, json!({ "body": body(group, seq) }));
                let sent = consumers[task].handle.send(message).await;
                round.history.finish(
                    op,
                    &sent
                        .as_ref()
                        .map(|s| json!({ "id": s.id, "duplicate": s.duplicate })),
                );
                round.after_operation(task, sent.is_ok());
                if sent.is_ok() {
                    last_sent[group] = Some(seq);
                }
            }
            Action::Receive => {
                let handle = consumers[task].handle.clone();
                if let Some(delivery) = receive(round, &handle, task).await {
                    let consumer = &mut consumers[task];
                    if let Some(previous) = consumer.current.replace(delivery) {
                        consumer.earlier.push(previous.receipt);
                    }
                }
            }
            Action::Ack => {
                let Some(delivery) = consumers[task].current.take() else {
                    round.history.skip(task, step.action);
                    continue;
                };
                let handle = consumers[task].handle.clone();
                let acked = ack(round, &handle, task, step.action, &delivery.receipt).await;
                round.after_operation(task, acked);
                consumers[task].earlier.push(delivery.receipt);
            }
            _ => {
                round.history.skip(task, step.action);
            }
        }
    }
    // The drain: every consumer acks what it holds, then whatever is left
    // is received and acked until the queue is empty.
    let drain = round.tasks();
    for consumer in &mut consumers {
        let held: Vec<Receipt> = consumer
            .current
            .take()
            .map(|d| d.receipt)
            .into_iter()
            .chain(consumer.earlier.drain(..))
            .collect();
        for receipt in held {
            ack(round, &control, drain, Action::Ack, &receipt).await;
        }
    }
    for _ in 0..(GROUPS * PER_GROUP * 4) {
        let Some(delivery) = receive(round, &control, drain).await else {
            break;
        };
        ack(round, &control, drain, Action::Ack, &delivery.receipt).await;
    }
    Ok(())
}

async fn receive(round: &mut Round, queue: &PgQueue, task: usize) -> Option<Received> {
    let op = round.history.invoke(task, Action::Receive, Value::Null);
    let received = queue.receive(ReceiveRequest::default()).await;
    round.history.finish(
        op,
        &received.as_ref().map(|r| {
            r.iter()
                .map(|m| json!({ "id": m.id, "body": m.body, "receipt": m.receipt.0 }))
                .collect::<Vec<_>>()
        }),
    );
    if task < round.tasks() {
        round.after_operation(task, received.is_ok());
    }
    received.ok()?.into_iter().next()
}

/// Deletes by `receipt` (or, under the stale-receipt mutant, by message id
/// alone); records the outcome with the receipt as input. True if deleted.
async fn ack(
    round: &mut Round,
    queue: &PgQueue,
    task: usize,
    action: Action,
    receipt: &Receipt,
) -> bool {
    let op = round
        .history
        .invoke(task, action, json!({ "receipt": receipt.0 }));
    let deleted = if round.mutant == Some(Mutant::QueueStaleDelete) {
        raw_delete(queue, receipt).await
    } else {
        queue.delete(receipt).await
    };
    round
        .history
        .finish(op, &deleted.as_ref().map(|()| "deleted"));
    deleted.is_ok()
}

/// The mutant's delete: by the id in the receipt, generation ignored.
async fn raw_delete(queue: &PgQueue, receipt: &Receipt) -> pgonce::Result<()> {
    let stale = || pgonce::Error::StaleReceipt {
        receipt: receipt.0.clone(),
    };
    let id: i64 = receipt
        .0
        .rsplit(':')
        .nth(1)
        .and_then(|id| id.parse().ok())
        .ok_or_else(stale)?;
    let done = sqlx::query(include_str!("sql/mutant_queue_delete.sql"))
        .bind(queue.name())
        .bind(id)
        .execute(queue.pool())
        .await?;
    if done.rows_affected() == 0 {
        return Err(stale());
    }
    Ok(())
}
