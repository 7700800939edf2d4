//! Which messages a FIFO receive may take, checked on random queue states
//! against a reference model.
//!
//! A FIFO receive of up to `k` messages must deliver, of the groups whose
//! first message (by position in the group) is visible, `min(k, that many)`
//! first messages, one per group, and nothing else. `pick_fifo.sql` finds
//! them two ways: a walk over the queue's oldest `32 * k` messages, then a
//! skip over the groups for heads newer than that window. Random sequences of
//! bulk sends (up to 300 messages to one group at once, so backlogs
//! outgrow the window), receives of 1 to 10, deletes, visibility timeouts
//! running out, delayed messages and messages moved to the back of their
//! group (as a redrive does) reach both ways; the tally says how many
//! receives needed the skip, and the test fails if none did.
//!
//! Sends are plain `INSERT`s (the send path is not under test here, and a
//! backlog of hundreds of messages would otherwise take hundreds of round
//! trips); receives and deletes go through [`PgQueue`].
//!
//! `MODEL_TEST_CASES` sets the number of cases (default 32); see
//! docs/testing.md.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use pgonce::{PgQueue, PgQueueOptions, Queue, QueueAttributes, Receipt, ReceiveRequest};
use pgonce_testkit::fresh_migrated_database;
use proptest::prelude::*;
use sqlx::PgPool;

const GROUPS: usize = 5;
/// The walk's window per message asked for (pick_fifo.sql).
const WINDOW_PER_MESSAGE: usize = 32;
const LONG: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone)]
enum Op {
    /// `count` visible messages to the back of `group`.
    Send { group: usize, count: usize },
    /// One message to the back of `group`, not visible for an hour: while
    /// it is its group's first, the group has no receivable head.
    SendDelayed { group: usize },
    /// A receive of up to `k`.
    Receive { k: usize },
    /// Deletes the in-flight message at this index (modulo how many there
    /// are), by its receipt.
    Delete(usize),
    /// Every visibility timeout and every delay runs out.
    TimePasses,
    /// The group's first message goes to the back of its group, with a
    /// position drawn after every message's, as a redrive puts it.
    ToTheBack { group: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..GROUPS, prop_oneof![2 => 1..4usize, 1 => 100..300usize])
            .prop_map(|(group, count)| Op::Send { group, count }),
        1 => (0..GROUPS).prop_map(|group| Op::SendDelayed { group }),
        6 => prop_oneof![1..3usize, 3..11usize].prop_map(|k| Op::Receive { k }),
        3 => (0..64usize).prop_map(Op::Delete),
        1 => Just(Op::TimePasses),
        1 => (0..GROUPS).prop_map(|group| Op::ToTheBack { group }),
    ]
}

/// A message of the queue as the model has it.
#[derive(Debug, Clone)]
struct Message {
    group: usize,
    /// Its place in its group (the id unless moved to the back).
    position: i64,
    visible: bool,
}

#[derive(Debug, Default)]
struct Model {
    /// By id: also the walk's order.
    messages: BTreeMap<i64, Message>,
    /// Receipts of the messages in flight, by id.
    in_flight: BTreeMap<i64, Receipt>,
}

impl Model {
    /// Each group's first message, by id.
    fn heads(&self) -> BTreeMap<usize, i64> {
        let mut heads: BTreeMap<usize, (i64, i64)> = BTreeMap::new();
        for (&id, m) in &self.messages {
            let head = heads.entry(m.group).or_insert((m.position, id));
            if m.position < head.0 {
                *head = (m.position, id);
            }
        }
        heads.into_iter().map(|(g, (_, id))| (g, id)).collect()
    }

    /// The ids a receive may deliver: each group's first message, when
    /// visible.
    fn receivable(&self) -> Vec<i64> {
        self.heads()
            .into_values()
            .filter(|id| self.messages[id].visible)
            .collect()
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    receives: u64,
    delivered: u64,
    /// Receives whose oldest `32 * k` messages held fewer than `k`
    /// receivable heads while newer ones existed: only the skip finds those.
    needed_the_skip: u64,
}

fn group_name(group: usize) -> String {
    format!("g{group}")
}

/// `count` messages to the back of `group`, visible now or in an hour,
/// inserted directly and recorded in the model.
async fn send(
    pool: &PgPool,
    queue: &PgQueue,
    model: &mut Model,
    group: usize,
    count: usize,
    delayed: bool,
) -> Result<(), String> {
    let ids: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO pgonce.queue_message (queue, body, group_id, visible_at)
         SELECT $1, 'm', $2, CASE WHEN $4 THEN now() + interval '1 hour' ELSE now() END
         FROM generate_series(1, $3)
         RETURNING id",
    )
    .bind(queue.name())
    .bind(group_name(group))
    .bind(count as i32)
    .bind(delayed)
    .fetch_all(pool)
    .await
    .map_err(|e| format!("insert: {e}"))?;
    for id in ids {
        let m = Message {
            group,
            position: id,
            visible: !delayed,
        };
        model.messages.insert(id, m);
    }
    Ok(())
}

async fn step(
    pool: &PgPool,
    queue: &PgQueue,
    model: &mut Model,
    op: &Op,
    tally: &mut Tally,
) -> Result<(), String> {
    match *op {
        Op::Send { group, count } => send(pool, queue, model, group, count, false).await?,
        Op::SendDelayed { group } => send(pool, queue, model, group, 1, true).await?,
        Op::Receive { k } => {
            let receivable = model.receivable();
            let window: Vec<i64> = model
                .messages
                .keys()
                .take(WINDOW_PER_MESSAGE * k)
                .copied()
                .collect();
            let in_window = receivable.iter().filter(|id| window.contains(id)).count();
            if in_window < k && receivable.len() > in_window {
                tally.needed_the_skip += 1;
            }
            let got = queue
                .receive(ReceiveRequest::up_to(k).visibility(LONG))
                .await
                .map_err(|e| format!("receive: {e}"))?;
            tally.receives += 1;
            tally.delivered += got.len() as u64;
            let expected = k.min(receivable.len());
            if got.len() != expected {
                return Err(format!(
                    "delivered {} messages, expected {expected} (receivable heads {receivable:?}, \
                     got {:?})",
                    got.len(),
                    got.iter().map(|m| &m.id).collect::<Vec<_>>()
                ));
            }
            for m in got {
                let id: i64 = m.id.parse().map_err(|e| format!("id {}: {e}", m.id))?;
                if !receivable.contains(&id) {
                    return Err(format!(
                        "delivered {id} (group {:?}), not a receivable head: {receivable:?}",
                        m.group_id
                    ));
                }
                let message = model.messages.get_mut(&id).expect("receivable");
                if !message.visible {
                    return Err(format!("delivered {id} twice in one receive"));
                }
                message.visible = false;
                model.in_flight.insert(id, m.receipt);
            }
        }
        Op::Delete(i) => {
            if model.in_flight.is_empty() {
                return Ok(());
            }
            let id = *model
                .in_flight
                .keys()
                .nth(i % model.in_flight.len())
                .unwrap();
            let receipt = model.in_flight.remove(&id).unwrap();
            queue
                .delete(&receipt)
                .await
                .map_err(|e| format!("delete {id}: {e}"))?;
            model.messages.remove(&id);
        }
        Op::TimePasses => {
            sqlx::query(
                "UPDATE pgonce.queue_message SET visible_at = now() - interval '1 second'
                 WHERE queue = $1 AND visible_at > now()",
            )
            .bind(queue.name())
            .execute(pool)
            .await
            .map_err(|e| format!("time passes: {e}"))?;
            model.messages.values_mut().for_each(|m| m.visible = true);
            // Their receipts stay current: no one received them since.
        }
        Op::ToTheBack { group } => {
            let Some(&head) = model.heads().get(&group) else {
                return Ok(());
            };
            let position: i64 = sqlx::query_scalar(
                "UPDATE pgonce.queue_message
                 SET group_position = nextval(pg_get_serial_sequence('pgonce.queue_message', 'id'))
                 WHERE id = $1 RETURNING group_position",
            )
            .bind(head)
            .fetch_one(pool)
            .await
            .map_err(|e| format!("to the back: {e}"))?;
            model.messages.get_mut(&head).unwrap().position = position;
        }
    }
    Ok(())
}

async fn run(pool: &PgPool, case: u64, ops: &[Op], tally: &mut Tally) -> Result<(), String> {
    let queue = PgQueue::create(
        pool,
        &format!("h{case}.fifo"),
        QueueAttributes::fifo().visibility_timeout(LONG),
        PgQueueOptions::default(),
    )
    .await
    .map_err(|e| format!("create: {e}"))?;
    let mut model = Model::default();
    for (i, op) in ops.iter().enumerate() {
        step(pool, &queue, &mut model, op, tally)
            .await
            .map_err(|e| format!("step {i} {op:?}: {e}"))?;
    }
    queue.purge().await.map_err(|e| format!("purge: {e}"))?;
    Ok(())
}

#[test]
fn a_fifo_receive_takes_one_visible_head_per_group_whatever_the_backlog() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (db, pool) = rt.block_on(fresh_migrated_database(4, pgonce::migrate));
    let tally = support::check_model(
        file!(),
        32,
        proptest::collection::vec(op(), 1..60),
        Tally::default(),
        |case, ops, tally| rt.block_on(run(&pool, case, ops, tally)),
    );
    // The run reached the skip, not only the walk.
    assert!(
        tally.needed_the_skip > 0,
        "no receive needed a head beyond the walk's window: {tally:?}"
    );
    drop(db);
}
