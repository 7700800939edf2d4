//! A reference model of a FIFO queue with a dead-letter queue, checked step
//! by step against PostgreSQL.
//!
//! Random sequences of sends to a few groups, receives from the queue and
//! from its dead-letter queue, releases and deletes by receipt (current or
//! stale), visibility timeouts running out and redrives run against both an
//! in-memory model of the contract and the database. After every step each
//! receive must deliver what the model says (each group's head, once it is
//! visible; a head received too often is moved instead), each receipt must
//! be honoured or refused as the model says, and every row must be where
//! the model has it. Independently of the model, no group may have two
//! messages in flight in one queue (I6).
//!
//! The model's order within a group: a sent message goes behind every
//! message of its group in its queue, and so does one moved to the
//! dead-letter queue and one redriven back (at the back, as SQS re-sends
//! it). A redrive moves each group's dead letters in their order, stopping
//! at the first that stays (in flight in the dead-letter queue); messages
//! sent to the dead-letter queue directly stay and hold nothing back.
//!
//! Time is moved, never waited for: a visibility timeout runs out by an
//! `UPDATE` that sets `visible_at` into the past.
//!
//! `MODEL_TEST_CASES` sets the number of cases (default 48); see
//! docs/testing.md.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use pgonce::{PgQueue, PgQueueOptions, Queue, QueueAttributes, ReceiveRequest, SendMessage};
use pgonce_testkit::fresh_migrated_database;
use proptest::prelude::*;
use sqlx::PgPool;
use support::queue_model::{
    delivered_as_modelled, outcome, read_rows, rows_match, step_and_compare, time_passes,
};

const GROUPS: usize = 3;
/// Receives of the source queue after which the next one dead-letters.
const MAX_RECEIVES: u32 = 2;
const LONG: Duration = Duration::from_secs(3600);
const SOURCE: usize = 0;
const DLQ: usize = 1;

#[derive(Debug, Clone)]
enum Op {
    /// A send to (queue, group): the dead-letter queue takes sends of its
    /// own too, which a redrive never moves.
    Send(usize, usize),
    Receive(usize),
    /// The receipt (counted from the newest issued) releases its message:
    /// visibility timeout zero.
    Release(usize),
    Delete(usize),
    /// Every visibility timeout runs out.
    TimePasses,
    Redrive,
}

/// Weighted so that the long path (receive, release, receive again,
/// dead-letter, the next message delivered, redrive while it is in flight)
/// comes up often.
fn op() -> impl Strategy<Value = Op> {
    let receipt = || prop_oneof![3 => 0..3usize, 1 => 0..32usize];
    prop_oneof![
        5 => (0..GROUPS).prop_map(|g| Op::Send(SOURCE, g)),
        1 => (0..GROUPS).prop_map(|g| Op::Send(DLQ, g)),
        6 => Just(Op::Receive(SOURCE)),
        2 => Just(Op::Receive(DLQ)),
        4 => receipt().prop_map(Op::Release),
        3 => receipt().prop_map(Op::Delete),
        2 => Just(Op::TimePasses),
        3 => Just(Op::Redrive),
    ]
}

/// A message as the contract says it is.
#[derive(Debug, Clone)]
struct Message {
    group: usize,
    queue: usize,
    /// Its place in its group: the model's own counter, drawn at the send
    /// and again at a redrive.
    position: u64,
    visible: bool,
    receive_count: u32,
    /// receive_count when it came into its queue (a move or a redrive).
    base: u32,
    /// Dead-lettered (from the source queue), so a redrive may move it.
    dead_lettered: bool,
    /// The delivery a receipt must name to act on it; none after a move.
    delivery: Option<u64>,
}

/// A receipt handed out by a receive.
#[derive(Debug, Clone)]
struct Issued {
    receipt: pgonce::Receipt,
    queue: usize,
    id: String,
    delivery: u64,
}

#[derive(Debug, Default)]
struct Model {
    messages: BTreeMap<String, Message>,
    receipts: Vec<Issued>,
    positions: u64,
    deliveries: u64,
}

impl Model {
    fn next_position(&mut self) -> u64 {
        self.positions += 1;
        self.positions
    }

    /// Ids of the messages in `queue`, each group's in its order.
    fn in_order(&self, queue: usize) -> Vec<String> {
        let mut ids: Vec<(&String, &Message)> = self
            .messages
            .iter()
            .filter(|(_, m)| m.queue == queue)
            .collect();
        ids.sort_by_key(|(_, m)| (m.group, m.position));
        ids.into_iter().map(|(id, _)| id.clone()).collect()
    }

    /// True when `issued` names its message's current delivery.
    fn valid(&self, issued: &Issued) -> bool {
        self.messages
            .get(&issued.id)
            .is_some_and(|m| m.queue == issued.queue && m.delivery == Some(issued.delivery))
    }
}

/// How often the paths under test came up, to show the run reached them.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    delivered: u64,
    dead_lettered: u64,
    redriven: u64,
    /// Redrives that found a message of the group in flight in the source.
    redriven_beside_in_flight: u64,
    refused: u64,
}

fn group_name(group: usize) -> String {
    format!("g{group}")
}

async fn step(
    pool: &PgPool,
    queues: &[PgQueue; 2],
    model: &mut Model,
    op: &Op,
    tally: &mut Tally,
) -> Result<(), String> {
    match op {
        Op::Send(queue, group) => {
            let sent = queues[*queue]
                .send(SendMessage::new("m").group(group_name(*group)))
                .await
                .map_err(|e| format!("send: {e}"))?;
            let position = model.next_position();
            model.messages.insert(
                sent.id,
                Message {
                    group: *group,
                    queue: *queue,
                    position,
                    visible: true,
                    receive_count: 0,
                    base: 0,
                    dead_lettered: false,
                    delivery: None,
                },
            );
        }
        Op::Receive(q) => {
            let got = queues[*q]
                .receive(ReceiveRequest::up_to(10))
                .await
                .map_err(|e| format!("receive: {e}"))?;
            // Each group's head, if visible, is delivered or (received too
            // often from the source) moved; nothing behind it is taken. A
            // receive that moved a head looks again, as its next statement
            // does: the message behind it is its group's head now.
            let mut expected = BTreeMap::new();
            loop {
                let mut moved = false;
                let mut seen_groups = [false; GROUPS];
                for id in model.in_order(*q) {
                    let position = model.positions + 1;
                    let m = model.messages.get_mut(&id).unwrap();
                    if std::mem::replace(&mut seen_groups[m.group], true) || !m.visible {
                        continue;
                    }
                    if *q == SOURCE && m.receive_count - m.base >= MAX_RECEIVES {
                        // To the back of its group in the dead-letter queue.
                        m.queue = DLQ;
                        m.position = position;
                        model.positions = position;
                        m.base = m.receive_count;
                        m.dead_lettered = true;
                        m.delivery = None;
                        tally.dead_lettered += 1;
                        moved = true;
                    } else {
                        model.deliveries += 1;
                        m.receive_count += 1;
                        m.visible = false;
                        m.delivery = Some(model.deliveries);
                        expected.insert(id, (m.receive_count, model.deliveries));
                    }
                }
                if !moved {
                    break;
                }
            }
            delivered_as_modelled(&got, &expected)?;
            tally.delivered += got.len() as u64;
            for r in got {
                model.receipts.push(Issued {
                    receipt: r.receipt,
                    queue: *q,
                    delivery: expected[&r.id].1,
                    id: r.id,
                });
            }
        }
        Op::Release(k) | Op::Delete(k) => {
            let Some(issued) = model
                .receipts
                .len()
                .checked_sub(1 + k % model.receipts.len().max(1))
                .map(|i| model.receipts[i].clone())
            else {
                return Ok(());
            };
            let valid = model.valid(&issued);
            let queue = &queues[issued.queue];
            let got = if matches!(op, Op::Release(_)) {
                queue
                    .change_visibility(&issued.receipt, Duration::ZERO)
                    .await
            } else {
                queue.delete(&issued.receipt).await
            };
            let want = if valid { "ok" } else { "stale" };
            if outcome(&got) != want {
                return Err(format!("{issued:?}: {got:?}, model {want}"));
            }
            if !valid {
                tally.refused += 1;
            } else if matches!(op, Op::Release(_)) {
                model.messages.get_mut(&issued.id).unwrap().visible = true;
            } else {
                model.messages.remove(&issued.id);
            }
        }
        Op::TimePasses => {
            time_passes(pool, queues).await?;
            model.messages.values_mut().for_each(|m| m.visible = true);
        }
        Op::Redrive => {
            let moved = queues[DLQ]
                .redrive()
                .await
                .map_err(|e| format!("redrive: {e}"))?;
            // Each group's dead letters in their order, up to the first
            // that stays (in flight here); messages sent here are no dead
            // letters: they stay and hold nothing back.
            let mut want = 0;
            let mut stopped = [false; GROUPS];
            for id in model.in_order(DLQ) {
                let (group, dead_lettered, visible) = {
                    let m = &model.messages[&id];
                    (m.group, m.dead_lettered, m.visible)
                };
                if !dead_lettered {
                    continue;
                }
                if stopped[group] || !visible {
                    stopped[group] = true;
                    continue;
                }
                if model
                    .messages
                    .values()
                    .any(|o| o.queue == SOURCE && o.group == group && !o.visible)
                {
                    tally.redriven_beside_in_flight += 1;
                }
                let position = model.next_position();
                let m = model.messages.get_mut(&id).unwrap();
                m.queue = SOURCE;
                m.position = position;
                m.dead_lettered = false;
                m.base = m.receive_count;
                m.delivery = None;
                want += 1;
            }
            if moved != want {
                return Err(format!("redrove {moved}, model {want}"));
            }
            tally.redriven += want;
        }
    }
    Ok(())
}

/// I6 on the rows alone: at most one message per group in flight per
/// queue; then the rows against the model's messages (`rows_match`).
async fn compare(pool: &PgPool, names: &[String; 2], model: &Model) -> Result<(), String> {
    let rows = read_rows(pool, names).await?;
    let mut in_flight: BTreeMap<(&str, Option<&str>), Vec<i64>> = BTreeMap::new();
    for r in rows.iter().filter(|r| !r.visible) {
        in_flight
            .entry((r.queue.as_str(), r.group_id.as_deref()))
            .or_default()
            .push(r.id);
    }
    if let Some(((queue, group), ids)) = in_flight.iter().find(|(_, ids)| ids.len() > 1) {
        return Err(format!(
            "I6: group {group:?} has {} messages in flight in {queue}: {ids:?}",
            ids.len()
        ));
    }
    rows_match(&rows, names, &model.messages, |m| {
        (m.queue, m.visible, m.receive_count)
    })
}

async fn run(pool: &PgPool, case: u64, ops: &[Op], tally: &mut Tally) -> Result<(), String> {
    let names = [format!("m{case}.fifo"), format!("m{case}-dlq.fifo")];
    let options = PgQueueOptions::default();
    let dlq = PgQueue::create(
        pool,
        &names[DLQ],
        QueueAttributes::fifo().visibility_timeout(LONG),
        options.clone(),
    )
    .await
    .map_err(|e| format!("create: {e}"))?;
    let source = PgQueue::create(
        pool,
        &names[SOURCE],
        QueueAttributes::fifo()
            .visibility_timeout(LONG)
            .dead_letter(names[DLQ].clone(), MAX_RECEIVES),
        options,
    )
    .await
    .map_err(|e| format!("create: {e}"))?;
    let queues = [source, dlq];
    let mut model = Model::default();
    let apply = async |model: &mut Model, op: &Op| step(pool, &queues, model, op, tally).await;
    let check = async |model: &Model| compare(pool, &names, model).await;
    step_and_compare(&mut model, ops, apply, check).await
}

#[test]
fn a_fifo_group_has_one_message_in_flight_across_dead_letters_and_redrives() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (db, pool) = rt.block_on(fresh_migrated_database(4, pgonce::migrate));
    let tally = support::check_model(
        file!(),
        48,
        proptest::collection::vec(op(), 1..80),
        Tally::default(),
        |case, ops, tally| rt.block_on(run(&pool, case, ops, tally)),
    );
    // The run reached the path under test.
    assert!(
        tally.redriven_beside_in_flight > 0,
        "no redrive met a message of its group in flight: {tally:?}"
    );
    drop(db);
}
