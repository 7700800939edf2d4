//! What the queue's two reference models check alike: the standard queues'
//! (tests/queue.rs, module `model`) and the FIFO queue's
//! (tests/queue_fifo_model.rs). Each model keeps its own messages, order
//! and receipt rules, and compares the database with them through these
//! checks, so the two cannot drift apart: a check made stricter or looser
//! here is so for both models.

use std::collections::BTreeMap;
use std::fmt::Debug;

use pgonce::{Error, PgQueue, Queue, Received};
use sqlx::PgPool;

/// A row of the queues under test, as the database has it (`group_id` is
/// `None` on a standard queue).
#[derive(Debug, sqlx::FromRow)]
pub struct Row {
    pub id: i64,
    pub queue: String,
    pub group_id: Option<String>,
    pub visible: bool,
    pub receive_count: i32,
}

/// Every row of the queues `names`, visible meaning `visible_at` has come.
pub async fn read_rows(pool: &PgPool, names: &[String]) -> Result<Vec<Row>, String> {
    sqlx::query_as(
        "SELECT id, queue, group_id, visible_at <= now() AS visible, receive_count \
         FROM pgonce.queue_message WHERE queue = ANY($1) ORDER BY id",
    )
    .bind(names.to_vec())
    .fetch_all(pool)
    .await
    .map_err(|e| format!("read rows: {e}"))
}

/// The rows against the model, after every step: the same set of message
/// ids (none lost, none left behind by a delete or a purge), and each
/// message in the queue the model has it in (`names[queue]`: a dead-letter
/// move or a redrive went where it should), visible exactly when the model
/// says (a receive hid it, a release or a timeout running out showed it
/// again), with the model's receive count (what decides the next
/// dead-letter move). `place` gives a model message's queue index,
/// visibility and receive count.
///
/// Why the rows and not only each call's answer: a call can answer right
/// and leave its row wrong (a receive that delivers but does not hide, a
/// move that reports but does not move), which no answer shows until some
/// later step, or never.
pub fn rows_match<M>(
    rows: &[Row],
    names: &[String],
    messages: &BTreeMap<String, M>,
    place: impl Fn(&M) -> (usize, bool, u32),
) -> Result<(), String> {
    let have: BTreeMap<String, (String, bool, u32)> = rows
        .iter()
        .map(|r| {
            (
                r.id.to_string(),
                (r.queue.clone(), r.visible, r.receive_count as u32),
            )
        })
        .collect();
    let want: BTreeMap<String, (String, bool, u32)> = messages
        .iter()
        .map(|(id, m)| {
            let (queue, visible, receive_count) = place(m);
            (id.clone(), (names[queue].clone(), visible, receive_count))
        })
        .collect();
    if have != want {
        return Err(format!("rows {have:?}, model {want:?}"));
    }
    Ok(())
}

/// Applies `ops` one at a time to the model and the database (`step`, which
/// also checks each call's answer), and after every one compares the
/// database with the model (`compare`): a divergence is caught at the step
/// that made it, not at the end of the case, and the error names that step.
pub async fn step_and_compare<M, Op: Debug>(
    model: &mut M,
    ops: &[Op],
    mut step: impl AsyncFnMut(&mut M, &Op) -> Result<(), String>,
    compare: impl AsyncFn(&M) -> Result<(), String>,
) -> Result<(), String> {
    for (i, op) in ops.iter().enumerate() {
        step(model, op)
            .await
            .map_err(|e| format!("step {i} {op:?}: {e}"))?;
        compare(model)
            .await
            .map_err(|e| format!("after step {i} {op:?}: {e}"))?;
    }
    Ok(())
}

/// A receive against the model: exactly the messages the model delivers
/// (`expected`: id to its receive count and delivery number), each with the
/// receive count the model has for this delivery; none more, none fewer.
pub fn delivered_as_modelled(
    got: &[Received],
    expected: &BTreeMap<String, (u32, u64)>,
) -> Result<(), String> {
    let delivered: BTreeMap<String, u32> = got
        .iter()
        .map(|r| (r.id.clone(), r.receive_count))
        .collect();
    let want: BTreeMap<String, u32> = expected
        .iter()
        .map(|(id, (c, _))| (id.clone(), *c))
        .collect();
    if delivered != want {
        return Err(format!("delivered {delivered:?}, model {want:?}"));
    }
    Ok(())
}

/// A receipt call's outcome as the models judge it: honoured (`"ok"`),
/// refused as stale (`"stale"`), or anything else, which no model expects.
pub fn outcome<T>(r: &pgonce::Result<T>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(Error::StaleReceipt { .. }) => "stale",
        Err(_) => "other error",
    }
}

/// Every visibility timeout in `queues` runs out, by moving `visible_at`
/// into the past; the caller makes every model message visible.
pub async fn time_passes(pool: &PgPool, queues: &[PgQueue]) -> Result<(), String> {
    sqlx::query(
        "UPDATE pgonce.queue_message \
         SET visible_at = least(visible_at, now() - interval '1 ms') \
         WHERE queue = ANY($1)",
    )
    .bind(
        queues
            .iter()
            .map(|q| q.name().to_string())
            .collect::<Vec<_>>(),
    )
    .execute(pool)
    .await
    .map_err(|e| format!("time passes: {e}"))?;
    Ok(())
}
