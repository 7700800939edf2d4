//! The PostgreSQL queue against a real PostgreSQL: the backend-independent
//! conformance suite (`pgonce::queue::conformance`, also run against SQS),
//! then what only this backend offers: transactional enqueue, one-statement
//! receives under racing sessions, typed errors for bad input.

mod support;

use support::database_with_queue;

use std::time::Duration;

use pgonce::IsolationLevel;
use pgonce::queue::conformance::*;
use pgonce::{
    Error, PgQueue, PgQueueOptions, Queue, QueueAttributes, Receipt, ReceiveRequest, Received,
    SendMessage, Sent,
};
use pgonce_testkit::{
    FAILSAFE, FaultProxy, Interleaving, NewConnections, fresh_database, fresh_migrated_database,
    wait_until,
};
use sqlx::{PgPool, Postgres, Transaction};

/// The FIFO receive statement, as `PgQueue::receive` runs it: $1 queue,
/// $2 how many to look at, $3 visibility ms (NULL: the queue's), $4 ids to
/// pass over, $5 how many to deliver at most.
const FIFO_RECEIVE: &str = concat!(
    include_str!("../src/queue/sql/receive_head.sql"),
    include_str!("../src/queue/sql/pick_fifo.sql"),
    include_str!("../src/queue/sql/receive_judge.sql"),
    include_str!("../src/queue/sql/receive_fate_capped.sql"),
    include_str!("../src/queue/sql/receive_act.sql"),
    include_str!("../src/queue/sql/receive_deliver.sql"),
    include_str!("../src/queue/sql/receive_report.sql"),
    include_str!("../src/queue/sql/receive_next_visible.sql")
);
/// A receive's first statement (no cap, four parameters).
const FIFO_RECEIVE_FIRST: &str = concat!(
    include_str!("../src/queue/sql/receive_head.sql"),
    include_str!("../src/queue/sql/pick_fifo.sql"),
    include_str!("../src/queue/sql/receive_judge.sql"),
    include_str!("../src/queue/sql/receive_fate.sql"),
    include_str!("../src/queue/sql/receive_act.sql"),
    include_str!("../src/queue/sql/receive_deliver.sql"),
    include_str!("../src/queue/sql/receive_report.sql"),
    include_str!("../src/queue/sql/receive_next_visible.sql")
);

async fn pool() -> PgPool {
    let (_db, pool) = fresh_migrated_database(20, pgonce::migrate).await;
    pool
}

/// Re-polls often, so waits for a visibility timeout end promptly.
fn fast_poll() -> PgQueueOptions {
    PgQueueOptions {
        poll_interval: Duration::from_millis(100),
        ..PgQueueOptions::default()
    }
}

/// Re-polls once a minute: within a test's wait, only a wake-up (NOTIFY,
/// or one receiver handing on to another) ends a long poll early.
fn slow_poll() -> PgQueueOptions {
    PgQueueOptions {
        poll_interval: Duration::from_secs(60),
        ..PgQueueOptions::default()
    }
}

async fn queue(pool: &PgPool, name: &str, attributes: QueueAttributes) -> PgQueue {
    PgQueue::create(pool, name, attributes, fast_poll())
        .await
        .unwrap()
}

fn one_second() -> QueueAttributes {
    QueueAttributes::default().visibility_timeout(Duration::from_secs(1))
}

async fn with_dead_letters(pool: &PgPool) -> (PgQueue, PgQueue) {
    let dlq = queue(pool, "jobs-dlq", QueueAttributes::default()).await;
    let q = queue(
        pool,
        "jobs",
        QueueAttributes::default().dead_letter("jobs-dlq", 2),
    )
    .await;
    (q, dlq)
}

#[tokio::test]
async fn at_least_once_when_a_consumer_dies_mid_handler() {
    let pool = pool().await;
    conformance_at_least_once_when_consumer_dies(&queue(&pool, "q", one_second()).await).await;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.queue_message")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        left, 0,
        "every message handled and deleted, none left behind"
    );
}

#[tokio::test]
async fn fifo_order_holds_with_many_consumers() {
    let pool = pool().await;
    conformance_fifo_order_with_many_consumers(&queue(&pool, "f", QueueAttributes::fifo()).await)
        .await;
}

#[tokio::test]
async fn fifo_groups_are_independent() {
    let pool = pool().await;
    conformance_fifo_groups_are_independent(&queue(&pool, "f", QueueAttributes::fifo()).await)
        .await;
}

#[tokio::test]
async fn requests_past_the_limits_are_refused() {
    let pool = pool().await;
    conformance_requests_past_the_limits_are_refused(&queue(&pool, "q", one_second()).await).await;
}

#[tokio::test]
async fn a_stale_receipt_deletes_and_extends_nothing() {
    let pool = pool().await;
    conformance_stale_receipt(&queue(&pool, "q", one_second()).await).await;
}

#[tokio::test]
async fn dead_letter_and_redrive() {
    let pool = pool().await;
    let (q, dlq) = with_dead_letters(&pool).await;
    let sent = q.send(SendMessage::new("probe")).await.unwrap();
    q.purge().await.unwrap();
    assert!(q.history(&sent.id).await.unwrap().is_none());
    conformance_dead_letter_and_redrive(&q, &dlq).await;
}

/// A FIFO queue `f.fifo` whose dead-letter queue `f-dlq.fifo` takes a
/// message at its third receive, holding messages `bodies_sent` of group
/// "g" sent in that order. The first is received and released twice, then
/// dead-lettered; the second is delivered. Returns the queue, the
/// dead-letter queue, the first message's id and the second's delivery, in
/// flight.
async fn fifo_head_dead_lettered(
    pool: &PgPool,
    bodies_sent: &[&str],
) -> (PgQueue, PgQueue, String, Received) {
    let dlq = queue(pool, "f-dlq.fifo", QueueAttributes::fifo()).await;
    let q = queue(
        pool,
        "f.fifo",
        QueueAttributes::fifo().dead_letter("f-dlq.fifo", 2),
    )
    .await;
    let mut ids = Vec::new();
    for body in bodies_sent {
        ids.push(q.send(SendMessage::new(*body).group("g")).await.unwrap().id);
    }
    for _ in 0..2 {
        let head = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
        assert_eq!(bodies(&head), [bodies_sent[0]]);
        q.change_visibility(&head[0].receipt, Duration::ZERO)
            .await
            .unwrap();
    }
    // The next receives move the head to the dead-letter queue, then
    // deliver the second message.
    for _ in 0..3 {
        let mut got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
        if !got.is_empty() {
            assert_eq!(bodies(&got), [bodies_sent[1]]);
            return (q, dlq, ids.remove(0), got.remove(0));
        }
    }
    panic!(
        "{} was not delivered after its head was dead-lettered",
        bodies_sent[1]
    );
}

#[tokio::test]
async fn a_redriven_fifo_message_waits_for_its_group_in_flight() {
    // A redrive brings m1 back while m2 of its group is in flight: it must
    // not be delivered beside m2. (Moved back with its id as its position,
    // m1 was its group's head again: two in flight.)
    let pool = pool().await;
    let (q, dlq, _, m2) = fifo_head_dead_lettered(&pool, &["m1", "m2"]).await;
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    let during = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert!(
        during.is_empty(),
        "delivered while m2 of the same group is in flight: {:?}",
        bodies(&during)
    );
    q.delete(&m2.receipt).await.unwrap();
    let after = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&after), ["m1"]);
}

#[tokio::test]
async fn a_redriven_fifo_message_rejoins_its_group_at_the_back_with_its_id() {
    // m1 dead-lettered, m2 in flight, m3 waiting; m4 sent after the
    // redrive. The group goes on m2, m3, m1, m4: the redriven message is
    // behind everything sent before the redrive (as SQS re-sends it), and
    // keeps its id and history.
    let pool = pool().await;
    let (q, dlq, m1_id, m2) = fifo_head_dead_lettered(&pool, &["m1", "m2", "m3"]).await;
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    q.send(SendMessage::new("m4").group("g")).await.unwrap();
    q.delete(&m2.receipt).await.unwrap();
    let order = one_at_a_time(&q, 3).await;
    assert_eq!(order[1].id, m1_id, "a redrive keeps the message's id");
    assert_eq!(bodies(&order), ["m3", "m1", "m4"]);
}

/// A FIFO queue `name` whose dead-letter queue `dead_letter_queue` (which
/// must exist) takes a message at its second receive.
async fn fifo_dead_lettering_at_second_receive(
    pool: &PgPool,
    name: &str,
    dead_letter_queue: &str,
) -> PgQueue {
    queue(
        pool,
        name,
        QueueAttributes::fifo().dead_letter(dead_letter_queue, 1),
    )
    .await
}

/// Queue `name` with `attributes` and its dead-letter queue `dead` (of the
/// same attributes), which takes a message at its second receive; both
/// handles with `options`.
async fn dead_lettering_at_second_receive(
    pool: &PgPool,
    name: &str,
    dead: &str,
    attributes: QueueAttributes,
    options: PgQueueOptions,
) -> (PgQueue, PgQueue) {
    let dlq = PgQueue::create(pool, dead, attributes.clone(), options.clone())
        .await
        .unwrap();
    let q = PgQueue::create(pool, name, attributes.dead_letter(dead, 1), options)
        .await
        .unwrap();
    (q, dlq)
}

/// `f.fifo` and its dead-letter queue `f-dlq.fifo`: w then x of group g
/// dead-lettered in that order, and w delivered from the dead-letter queue
/// (returned, in flight there).
async fn group_dead_lettered_with_its_head_in_flight(
    pool: &PgPool,
) -> (PgQueue, PgQueue, Vec<Received>) {
    let dlq = queue(pool, "f-dlq.fifo", QueueAttributes::fifo()).await;
    let q = fifo_dead_lettering_at_second_receive(pool, "f.fifo", "f-dlq.fifo").await;
    q.send(SendMessage::new("w").group("g")).await.unwrap();
    q.send(SendMessage::new("x").group("g")).await.unwrap();
    let w = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&w), ["w"]);
    q.change_visibility(&w[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    // The receive that moves w looks on and delivers x, now the head.
    let x = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&x), ["x"]);
    q.change_visibility(&x[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    assert!(
        q.receive(ReceiveRequest::up_to(10))
            .await
            .unwrap()
            .is_empty()
    );
    let w = dlq.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&w), ["w"]);
    (q, dlq, w)
}

/// Receives `body` from `q` (a queue that dead-letters at the second
/// receive), releases it, and receives again, which moves it to the
/// dead-letter queue. Panics if anything else comes.
async fn dead_letter_next(q: &PgQueue, body: &str) {
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&got), [body], "first delivery from {}", q.name());
    q.change_visibility(&got[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    let moved = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert!(moved.is_empty(), "{body} was delivered again, not moved");
}

/// A FIFO dead-letter queue shared by two FIFO queues: y (sent to b.fifo
/// first, so the smaller id) is dead-lettered while x of the same group,
/// dead-lettered from a.fifo before it, is in flight in d.fifo. Keeping its
/// place, y was d.fifo's head of g and was delivered beside x; a move now
/// puts it at the back of the group there.
#[tokio::test]
async fn a_shared_fifo_dead_letter_queue_keeps_one_message_of_a_group_in_flight() {
    let pool = pool().await;
    let d = queue(&pool, "d.fifo", QueueAttributes::fifo()).await;
    let a = fifo_dead_lettering_at_second_receive(&pool, "a.fifo", "d.fifo").await;
    let b = fifo_dead_lettering_at_second_receive(&pool, "b.fifo", "d.fifo").await;
    b.send(SendMessage::new("y").group("g")).await.unwrap();
    a.send(SendMessage::new("x").group("g")).await.unwrap();
    dead_letter_next(&a, "x").await;
    let x = d.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&x), ["x"]);
    dead_letter_next(&b, "y").await;
    let during = d.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert!(
        during.is_empty(),
        "d.fifo delivered {:?} while x of group g is in flight there",
        bodies(&during)
    );
    d.delete(&x[0].receipt).await.unwrap();
    let next = d.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&next), ["y"]);
}

/// The same with one source: t.fifo is s.fifo's dead-letter queue and also
/// takes sends of its own. m (sent to s.fifo first) is dead-lettered while
/// t.fifo's own n of the same group is in flight: m goes behind n.
#[tokio::test]
async fn a_dead_letter_move_waits_behind_the_dead_letter_queues_own_message_in_flight() {
    let pool = pool().await;
    let t = queue(&pool, "t.fifo", QueueAttributes::fifo()).await;
    let s = fifo_dead_lettering_at_second_receive(&pool, "s.fifo", "t.fifo").await;
    s.send(SendMessage::new("m").group("g")).await.unwrap();
    t.send(SendMessage::new("n").group("g")).await.unwrap();
    let n = t.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&n), ["n"]);
    dead_letter_next(&s, "m").await;
    let during = t.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert!(
        during.is_empty(),
        "t.fifo delivered {:?} while n of group g is in flight there",
        bodies(&during)
    );
}

/// A dead-letter move into a FIFO queue takes the group's lock there, as a
/// send does, but never waits for it, step by step: A sends n to t.fifo's
/// group g in an open transaction. B's receive of s.fifo, where m of group
/// g is due to be dead-lettered into t.fifo and k of group h to be
/// delivered, returns at once: k delivered with its whole lease, m held
/// back in s.fifo. (A receive that waited for A handed out leases counted
/// from before the wait, already run out if A took longer, and deadlocked
/// with a sender locking two groups in its own order.) A's transaction
/// then sends to another group and commits; the next receive moves m,
/// behind n.
#[tokio::test]
async fn a_dead_letter_move_never_waits_for_a_sender_and_goes_behind_its_send() {
    let db = fresh_database().await;
    let setup = db.pool(2).await.unwrap();
    pgonce::migrate(&setup).await.unwrap();
    let t = queue(&setup, "t.fifo", QueueAttributes::fifo()).await;
    let s = fifo_dead_lettering_at_second_receive(&setup, "s.fifo", "t.fifo").await;
    s.send(SendMessage::new("m").group("g")).await.unwrap();
    let first = s.receive(ReceiveRequest::up_to(10)).await.unwrap();
    s.change_visibility(&first[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    s.send(SendMessage::new("k").group("h")).await.unwrap();

    let race = pgonce_testkit::Interleaving::new(db.options())
        .await
        .unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let ta = PgQueue::open(a.pool(), "t.fifo", fast_poll())
        .await
        .unwrap();
    let sb = PgQueue::open(b.pool(), "s.fifo", fast_poll())
        .await
        .unwrap();
    let mut tx = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(
        &a,
        "send n to t.fifo/g in tx",
        ta.send_in(&mut tx, SendMessage::new("n").group("g")),
    )
    .await
    .unwrap()
    .unwrap();
    let lease = Duration::from_secs(60);
    let got = race
        .step(
            &b,
            "receive s.fifo",
            sb.receive(ReceiveRequest::up_to(10).visibility(lease)),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(bodies(&got), ["k"], "k delivered, m held back");
    let lease_left: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM visible_at - clock_timestamp())::float8 \
         FROM pgonce.queue_message WHERE body = 'k'",
    )
    .fetch_one(&setup)
    .await
    .unwrap();
    assert!(
        lease_left > 30.0,
        "k's lease of 60 s has {lease_left} s left"
    );
    let m_in: String =
        sqlx::query_scalar("SELECT queue FROM pgonce.queue_message WHERE body = 'm'")
            .fetch_one(&setup)
            .await
            .unwrap();
    assert_eq!(m_in, "s.fifo");
    race.step(
        &a,
        "send o to t.fifo/h in the same tx",
        ta.send_in(&mut tx, SendMessage::new("o").group("h")),
    )
    .await
    .unwrap()
    .unwrap();
    race.step(&a, "commit", tx.commit()).await.unwrap().unwrap();
    assert!(
        s.receive(ReceiveRequest::up_to(10))
            .await
            .unwrap()
            .is_empty()
    );
    // t.fifo: the heads of g and h first, then m behind n.
    let heads = t.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&heads), ["n", "o"]);
    for head in &heads {
        t.delete(&head.receipt).await.unwrap();
    }
    assert_eq!(bodies(&one_at_a_time(&t, 1).await), ["m"]);
}

/// A dead-letter queue of the other kind is refused, as in SQS (a FIFO
/// queue cannot order a standard queue's messages, which have no group),
/// and so is re-creating a queue as the other kind: a typed error, and the
/// queue as it was.
#[tokio::test]
async fn a_queue_of_the_other_kind_is_refused_and_nothing_is_written() {
    let pool = pool().await;
    queue(&pool, "d.fifo", QueueAttributes::fifo()).await;
    queue(&pool, "d", QueueAttributes::default()).await;
    for (name, attributes) in [
        ("s", QueueAttributes::default().dead_letter("d.fifo", 1)),
        ("f.fifo", QueueAttributes::fifo().dead_letter("d", 1)),
    ] {
        let refused = PgQueue::create(&pool, name, attributes, fast_poll()).await;
        assert!(
            matches!(refused, Err(Error::Invalid { .. })),
            "{name}: {refused:?}"
        );
    }
    let visibility = |name: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT visibility_timeout_ms FROM pgonce.queue WHERE name = $1",
            )
            .bind(name)
            .fetch_optional(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(visibility("s").await, None);
    assert_eq!(visibility("f.fifo").await, None);
    let before = visibility("d").await;
    let refused = PgQueue::create(
        &pool,
        "d",
        QueueAttributes::fifo().visibility_timeout(Duration::from_secs(7)),
        fast_poll(),
    )
    .await;
    assert!(matches!(refused, Err(Error::Invalid { .. })), "{refused:?}");
    assert_eq!(
        visibility("d").await,
        before,
        "the standard queue d unchanged"
    );
}

/// A dead-letter queue deleted by hand and recreated as the other kind
/// while `create` runs never leaves a queue whose dead-letter queue is of
/// the other kind: `create` used to check the kind in a statement of its
/// own, so a replacement between that check and the write slipped through.
///
/// Driven step by step: `create` runs on a pool of one whose
/// `before_acquire`, at its `nth` acquire, replaces `d` (standard) by a
/// FIFO `d` when `s` does not exist yet (so before `create` wrote it).
/// Whatever `create` answers, `s` then either does not exist or has a
/// dead-letter queue of its own kind.
#[tokio::test]
async fn a_dead_letter_queue_replaced_while_create_runs_is_never_of_the_other_kind() {
    for nth in 1..=3 {
        let (db, pool) = fresh_migrated_database(20, pgonce::migrate).await;
        queue(&pool, "d", QueueAttributes::default()).await;
        let acquires = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let replaced = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hooked = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .before_acquire({
                let (acquires, replaced, pool) = (acquires.clone(), replaced.clone(), pool.clone());
                move |_, _| {
                    let (acquires, replaced, pool) =
                        (acquires.clone(), replaced.clone(), pool.clone());
                    Box::pin(async move {
                        let at = acquires.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                        let source_exists: bool = sqlx::query_scalar(
                            "SELECT EXISTS (SELECT 1 FROM pgonce.queue WHERE name = 's')",
                        )
                        .fetch_one(&pool)
                        .await?;
                        if at == nth && !source_exists {
                            sqlx::raw_sql(
                                "BEGIN;
                                 DELETE FROM pgonce.queue WHERE name = 'd';
                                 INSERT INTO pgonce.queue (name, fifo, visibility_timeout_ms,
                                     retention_ms, delay_ms, dedup_window_ms)
                                 VALUES ('d', true, 30000, 345600000, 0, 300000);
                                 COMMIT;",
                            )
                            .execute(&pool)
                            .await?;
                            replaced.store(true, std::sync::atomic::Ordering::SeqCst);
                        }
                        Ok(true)
                    })
                }
            })
            .connect_with(db.options())
            .await
            .unwrap();
        let created = PgQueue::create(
            &hooked,
            "s",
            QueueAttributes::default().dead_letter("d", 1),
            fast_poll(),
        )
        .await;
        let kinds: Option<(bool, bool)> = sqlx::query_as(
            "SELECT s.fifo, d.fifo FROM pgonce.queue s
             JOIN pgonce.queue d ON d.name = s.dead_letter_queue
             WHERE s.name = 's'",
        )
        .fetch_optional(&pool)
        .await
        .unwrap();
        let replaced = replaced.load(std::sync::atomic::Ordering::SeqCst);
        match kinds {
            Some((source, dead_letter)) => assert_eq!(
                source,
                dead_letter,
                "replaced at acquire {nth} ({replaced}): s created with a dead-letter queue \
                 of the other kind, create answered {:?}",
                created.map(|q| q.name().to_string())
            ),
            None => assert!(
                matches!(created, Err(Error::Invalid { .. })),
                "replaced at acquire {nth} ({replaced}): no s, yet create answered {:?}",
                created.map(|q| q.name().to_string())
            ),
        }
    }
}
/// `create` waits for a dead-letter queue being deleted by hand, and does
/// not take the queue recreated in its place as the other kind, step by
/// step: A deletes `d` (standard) and creates `d` as FIFO, uncommitted; B's
/// `create` of `s` with `d` as its dead-letter queue waits for A (seen in
/// pg_blocking_pids). A commits: B is refused, as for any dead-letter
/// queue of the other kind, and `s` does not exist.
#[tokio::test]
async fn create_waits_for_a_dead_letter_queue_being_replaced_and_refuses_it() {
    let (db, race, mut sessions) = raced(QueueAttributes::default(), &["A", "B"]).await;
    let (b, _) = sessions.pop().unwrap();
    let (a, _) = sessions.pop().unwrap();
    queue(a.pool(), "d", QueueAttributes::default()).await;
    let mut replace = a.pool().begin().await.unwrap();
    race.step(
        &a,
        "replace d by a FIFO d, uncommitted",
        sqlx::raw_sql(
            "DELETE FROM pgonce.queue WHERE name = 'd';
             INSERT INTO pgonce.queue (name, fifo, visibility_timeout_ms, retention_ms,
                 delay_ms, dedup_window_ms)
             VALUES ('d', true, 30000, 345600000, 0, 300000);",
        )
        .execute(&mut *replace),
    )
    .await
    .unwrap()
    .unwrap();
    let b_pool = b.pool().clone();
    let create = race
        .step_blocks(&b, "create s with d as its dead-letter queue", async move {
            PgQueue::create(
                &b_pool,
                "s",
                QueueAttributes::default().dead_letter("d", 1),
                fast_poll(),
            )
            .await
            .map(|_| ())
        })
        .await
        .unwrap();
    assert_eq!(create.blocked_by(), ["A"]);
    race.step(&a, "commit", replace.commit())
        .await
        .unwrap()
        .unwrap();
    let refused = create.resume().await.unwrap();
    assert!(
        matches!(refused, Err(Error::Invalid { .. })),
        "a FIFO d refused: {refused:?}"
    );
    let setup = db.pool(1).await.unwrap();
    let s: Option<String> = sqlx::query_scalar("SELECT name FROM pgonce.queue WHERE name = 's'")
        .fetch_optional(&setup)
        .await
        .unwrap();
    assert_eq!(s, None, "nothing written");
}

/// A database configured before dead-letter queues had to be of their
/// source's kind: migration 0131, after which a FIFO queue's receive sees
/// grouped messages only, stops and names the queues to change, instead of
/// stranding a standard queue's dead letters in a FIFO queue.
#[tokio::test]
async fn the_fifo_walk_migration_stops_on_a_dead_letter_queue_of_the_other_kind() {
    let pool = pool().await;
    queue(&pool, "d.fifo", QueueAttributes::fifo()).await;
    queue(&pool, "s", QueueAttributes::default()).await;
    sqlx::query(
        "UPDATE pgonce.queue SET dead_letter_queue = 'd.fifo', max_receive_count = 1 \
         WHERE name = 's'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let migrate_0131 = async || {
        sqlx::raw_sql(include_str!("../migrations/0131_queue_fifo_walk.sql"))
            .execute(&pool)
            .await
            .unwrap_err()
            .to_string()
    };
    let refused = migrate_0131().await;
    assert!(
        refused.contains("s (standard) -> d.fifo (FIFO)"),
        "{refused}"
    );
    // A dead letter without a group already in the FIFO queue, its source
    // since changed: the migration names the queue holding it.
    sqlx::raw_sql(
        "UPDATE pgonce.queue SET dead_letter_queue = NULL, max_receive_count = NULL \
         WHERE name = 's'; \
         INSERT INTO pgonce.queue_message (queue, body, visible_at, dead_lettered_from) \
         VALUES ('d.fifo', 'stranded', now(), 's')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let refused = migrate_0131().await;
    assert!(
        refused.contains("FIFO queues holding messages without a group: d.fifo"),
        "{refused}"
    );
}

/// `s.fifo` dead-lettering into `t.fifo` at the second receive: heads of
/// the groups `due` received once and released (due to move, smallest
/// ids), then one message of its own group for each of `then`.
async fn heads_due_to_move_then(pool: &PgPool, due: &[&str], then: &[&str]) -> (PgQueue, PgQueue) {
    let t = queue(pool, "t.fifo", QueueAttributes::fifo()).await;
    let s = fifo_dead_lettering_at_second_receive(pool, "s.fifo", "t.fifo").await;
    for g in due {
        s.send(SendMessage::new(format!("due-{g}")).group(*g))
            .await
            .unwrap();
    }
    let first = s.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(first.len(), due.len());
    for m in &first {
        s.change_visibility(&m.receipt, Duration::ZERO)
            .await
            .unwrap();
    }
    for body in then {
        s.send(SendMessage::new(*body).group(*body)).await.unwrap();
    }
    (t, s)
}

/// FIFO heads due to move to the dead-letter queue, whose groups there a
/// sender holds, take no place of the batch: with four of them first, a
/// receive of one gets b, and a long poll of one gets c (each used to get
/// nothing, at every try while the sender was open). Once the sender is
/// gone the heads move.
#[tokio::test]
async fn heads_whose_move_waits_for_a_sender_take_no_place_in_the_batch() {
    let pool = pool().await;
    let held = ["g1", "g2", "g3", "g4"];
    let (t, s) = heads_due_to_move_then(&pool, &held, &["b", "c"]).await;
    let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    for g in held {
        t.send_in(&mut tx, SendMessage::new(format!("n-{g}")).group(g))
            .await
            .unwrap();
    }
    let now = s.receive(ReceiveRequest::up_to(1)).await.unwrap();
    let polled = s
        .receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!((bodies(&now), bodies(&polled)), (vec!["b"], vec!["c"]));
    tx.rollback().await.unwrap();
    assert!(
        s.receive(ReceiveRequest::up_to(10))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(t.stats().await.unwrap().depth, 4, "the four heads moved");
}

/// A receive that looks again past held heads acts on each message once:
/// b, delivered with no visibility timeout by the first statement, is
/// visible again to the second, which passes over it as over the held
/// head. (The second statement moved it to the dead-letter queue, its
/// receipt stale before the caller saw it; with a higher threshold it came
/// back twice.)
#[tokio::test]
async fn a_receive_past_held_heads_delivers_each_message_once() {
    let pool = pool().await;
    let (t, s) = heads_due_to_move_then(&pool, &["g"], &["b"]).await;
    let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    t.send_in(&mut tx, SendMessage::new("n").group("g"))
        .await
        .unwrap();
    let got = s
        .receive(ReceiveRequest::up_to(10).visibility(Duration::ZERO))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(bodies(&got), ["b"]);
    // Nor acts on it again: received once here (the next receive would
    // move it), it is still in s.fifo under the receipt just handed out.
    let now = s.history(&got[0].id).await.unwrap().unwrap();
    assert_eq!(now.queue, "s.fifo");
    s.delete(&got[0].receipt).await.unwrap();
}

/// Content-based deduplication as the queue has it now, also through a
/// handle opened before `create` changed it (a handle used to keep what it
/// read at open): turned on, identical bodies sent alone or in a batch are
/// duplicates of the first; turned off again, the same handle sends them
/// all.
#[tokio::test]
async fn content_based_deduplication_follows_the_queue_on_handles_opened_before() {
    let pool = pool().await;
    let old = queue(&pool, "f.fifo", QueueAttributes::fifo()).await;
    let by_content = |on: bool| QueueAttributes {
        content_based_dedup: on,
        ..QueueAttributes::fifo()
    };
    queue(&pool, "f.fifo", by_content(true)).await;
    let first = old.send(SendMessage::new("same").group("g")).await.unwrap();
    let again = old.send(SendMessage::new("same").group("g")).await.unwrap();
    assert!(!first.duplicate && again.duplicate, "{first:?} {again:?}");
    assert_eq!(again.id, first.id);
    let batch = old
        .send_batch(vec![
            SendMessage::new("same").group("g"),
            SendMessage::new("other").group("g"),
        ])
        .await
        .unwrap();
    assert_eq!(
        batch.iter().map(|s| s.duplicate).collect::<Vec<_>>(),
        [true, false]
    );
    assert_eq!(old.stats().await.unwrap().depth, 2);
    queue(&pool, "f.fifo", by_content(false)).await;
    let now_off = old.send(SendMessage::new("same").group("g")).await.unwrap();
    let batch = old
        .send_batch(vec![
            SendMessage::new("same").group("g"),
            SendMessage::new("other").group("g"),
        ])
        .await
        .unwrap();
    assert!(
        !now_off.duplicate && batch.iter().all(|s| !s.duplicate),
        "{now_off:?} {batch:?}"
    );
    assert_eq!(old.stats().await.unwrap().depth, 5);
}

/// A deduplicated batch refused because its handle saw an old setting
/// (content-based deduplication turned off since it opened) holds no key of
/// the refused attempt when it retries under the queue's setting: keys kept
/// from a first attempt would be taken out of order with the retry's, which
/// can deadlock two senders. The planner runs a WHERE's conditions in the
/// order of its cost estimates, and it ran the locking before the check.
#[tokio::test]
async fn a_batch_refused_for_an_old_setting_keeps_no_key_of_that_attempt() {
    let pool = pool().await;
    let by_content = |on: bool| QueueAttributes {
        content_based_dedup: on,
        ..QueueAttributes::fifo()
    };
    let old = queue(&pool, "k.fifo", by_content(true)).await;
    queue(&pool, "k.fifo", by_content(false)).await;
    let mut tx = pool.begin().await.unwrap();
    let sent = old
        .send_batch_in(
            &mut tx,
            vec![
                SendMessage::new("one").group("g"),
                SendMessage::new("two").group("g"),
            ],
        )
        .await
        .unwrap();
    assert!(sent.iter().all(|s| !s.duplicate), "{sent:?}");
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks
         WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(
        held, 1,
        "the group's key alone, none of the refused attempt's content ids"
    );
    tx.commit().await.unwrap();
}

/// Two batches queued behind a holder, step by step: X runs `hold` in a
/// transaction it keeps open; the first batch (session "First") is seen
/// waiting for X, the second ("Second") for the first; X rolls back.
/// Returns what each batch answered: a deadlock between them is one of
/// them answering 40P01. `open` opens the two batches' handles on the two
/// sessions' pools, so a test chooses what each handle knows of the queue;
/// `hold` gets a handle on X's.
async fn batches_queued_behind_a_holder(
    db: &pgonce_testkit::ScratchDatabase,
    hold: impl AsyncFnOnce(&PgQueue, &mut Transaction<'static, Postgres>),
    open: impl AsyncFnOnce(&PgPool, &PgPool) -> (PgQueue, PgQueue),
    first: Vec<SendMessage>,
    second: Vec<SendMessage>,
) -> (pgonce::Result<Vec<Sent>>, pgonce::Result<Vec<Sent>>) {
    let race = pgonce_testkit::Interleaving::new(db.options())
        .await
        .unwrap();
    let x = race.session("X").await.unwrap();
    let a = race.session("First").await.unwrap();
    let b = race.session("Second").await.unwrap();
    let (qa, qb) = open(a.pool(), b.pool()).await;
    let qx = open_f_fifo(x.pool()).await;
    let mut xtx = x.pool().begin().await.unwrap();
    race.step(&x, "hold, open", hold(&qx, &mut xtx))
        .await
        .unwrap();
    let first = race
        .step_blocks(&a, "send the first batch", async move {
            qa.send_batch(first).await
        })
        .await
        .unwrap();
    assert_eq!(first.blocked_by(), ["X"]);
    let second = race
        .step_blocks(&b, "send the second batch", async move {
            qb.send_batch(second).await
        })
        .await
        .unwrap();
    assert_eq!(second.blocked_by(), ["First"]);
    race.step(&x, "roll back", xtx.rollback())
        .await
        .unwrap()
        .unwrap();
    (
        first.resume().await.unwrap(),
        second.resume().await.unwrap(),
    )
}

async fn open_f_fifo(pool: &PgPool) -> PgQueue {
    PgQueue::open(pool, "f.fifo", fast_poll()).await.unwrap()
}

/// A database with queue f.fifo, for [`batches_queued_behind_a_holder`].
async fn f_fifo_database() -> (pgonce_testkit::ScratchDatabase, PgPool) {
    database_with_queue("f.fifo", QueueAttributes::fifo()).await
}

/// Two batches that share deduplication ids in different orders, on FIFO
/// groups of their own: X holds the claim of "x" (sent in its open
/// transaction); A = [a, x, b] waits for X; B = [b, a] waits for A. When X
/// rolls back, A sends its three and B's two are duplicates of A's. Claims
/// taken in each batch's own order made B hold b while waiting for a, and
/// A wait for b after x: a deadlock, B refused with 40P01. The ids' locks,
/// taken first and in one order, leave nothing to cycle.
#[tokio::test]
async fn two_batches_sharing_deduplication_ids_do_not_deadlock() {
    let (db, _setup) = f_fifo_database().await;
    let batch = |group: &str, ids: &[&str]| -> Vec<SendMessage> {
        ids.iter()
            .map(|id| SendMessage::new(*id).group(group).dedup(*id))
            .collect()
    };
    let (a, b) = batches_queued_behind_a_holder(
        &db,
        async |qx, tx| {
            let x = SendMessage::new("x").group("g3").dedup("x");
            qx.send_in(tx, x).await.unwrap();
        },
        async |a, b| (open_f_fifo(a).await, open_f_fifo(b).await),
        batch("g1", &["a", "x", "b"]),
        batch("g2", &["b", "a"]),
    )
    .await;
    let (sent_by_a, sent_by_b) = (a.unwrap(), b.unwrap());
    assert!(sent_by_a.iter().all(|s| !s.duplicate), "{sent_by_a:?}");
    assert!(sent_by_b.iter().all(|s| s.duplicate), "{sent_by_b:?}");
    assert_eq!(
        [&sent_by_b[0].id, &sent_by_b[1].id],
        [&sent_by_a[2].id, &sent_by_a[0].id]
    );
}

/// The same through a handle that does not know the queue deduplicates
/// by content (opened before `create` turned it on). Lock keys are hashes,
/// so the test picks a group `gx` and an id `e` whose keys fall, in the
/// order sends take them, after the key of body "B"'s content id and
/// before the other: X holds gx; B, which knows, sends [body "B" in gx,
/// "b2" in gx with id e], takes "B"'s content id and waits for X; A, which
/// does not know, sends ["a1" in ga with id e, body "B" in ga] and waits
/// for B. A's second message needs the id of its body, which A learns only
/// when its send finds the setting changed: the batch used to take that
/// lock then, after e, and deadlocked with B when X let go (40P01). A
/// batch now locks the content id of every message without an id of its
/// own up front.
#[tokio::test]
async fn a_batch_from_a_handle_behind_the_queues_settings_does_not_deadlock() {
    let (db, setup) = f_fifo_database().await;
    #[derive(sqlx::FromRow)]
    struct Names {
        group: String,
        id: String,
    }
    let Names { group: gx, id: e } = sqlx::query_as(
        "WITH body AS (
             SELECT pgonce.lock_key('pgonce.queue.dedup/f.fifo',
                                    encode(sha256(convert_to('B', 'UTF8')), 'hex')) AS k),
         groups AS (
             SELECT 'g' || i AS name, pgonce.lock_key('pgonce.queue/f.fifo', 'g' || i) AS k
             FROM generate_series(1, 100) AS i),
         ids AS (
             SELECT 'e' || i AS name, pgonce.lock_key('pgonce.queue.dedup/f.fifo', 'e' || i) AS k
             FROM generate_series(1, 100) AS i)
         SELECT groups.name AS group, ids.name AS id
         FROM body, groups, ids
         WHERE body.k < groups.k AND groups.k < ids.k
         ORDER BY groups.name, ids.name
         LIMIT 1",
    )
    .fetch_one(&setup)
    .await
    .unwrap();
    let (b, a) = batches_queued_behind_a_holder(
        &db,
        async |_, tx| {
            sqlx::query("SELECT pg_advisory_xact_lock(pgonce.lock_key('pgonce.queue/f.fifo', $1))")
                .bind(&gx)
                .execute(&mut **tx)
                .await
                .unwrap();
        },
        async |b, a| {
            // A's handle is open before the queue deduplicates by content.
            let behind = open_f_fifo(a).await;
            let by_content = QueueAttributes {
                content_based_dedup: true,
                ..QueueAttributes::fifo()
            };
            queue(&setup, "f.fifo", by_content).await;
            (open_f_fifo(b).await, behind)
        },
        vec![
            SendMessage::new("B").group(&gx),
            SendMessage::new("b2").group(&gx).dedup(&e),
        ],
        vec![
            SendMessage::new("a1").group("ga").dedup(&e),
            SendMessage::new("B").group("ga"),
        ],
    )
    .await;
    let (sent_by_b, sent_by_a) = (b.unwrap(), a.unwrap());
    assert!(sent_by_b.iter().all(|s| !s.duplicate), "{sent_by_b:?}");
    assert!(sent_by_a.iter().all(|s| s.duplicate), "{sent_by_a:?}");
    assert_eq!(
        [&sent_by_a[0].id, &sent_by_a[1].id],
        [&sent_by_b[1].id, &sent_by_b[0].id]
    );
}

/// A deduplication window runs from the send, not from the start of the
/// transaction it is sent in: an id sent late in a transaction that had
/// been open longer than the window, then committed, still makes an
/// immediate resend a duplicate. (It used to be claimed already expired.)
#[tokio::test]
async fn a_dedup_window_runs_from_the_send_in_a_long_transaction() {
    let pool = pool().await;
    let attributes = QueueAttributes::fifo().dedup_window(Duration::from_secs(2));
    let q = queue(&pool, "w.fifo", attributes).await;
    let mut tx = pool.begin().await.unwrap();
    // Time passing inside the transaction is what this is about.
    sqlx::query("SELECT pg_sleep(2.5)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let first = q
        .send_in(&mut tx, SendMessage::new("m").group("g").dedup("x"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let again = q
        .send(SendMessage::new("m").group("g").dedup("x"))
        .await
        .unwrap();
    assert!(again.duplicate, "{again:?}");
    assert_eq!(again.id, first.id);
    assert_eq!(q.stats().await.unwrap().depth, 1);
}

/// A delay runs from the send, not from the start of the transaction it
/// is sent in: messages sent with a delay of one second, by `send_in` and
/// by `send_batch_in` (with and without a deduplication id, the two ways a
/// batch is sent), in a transaction that has been open for a second,
/// become visible a second after they were sent. (They were visible a
/// second after the transaction began: a delay shorter than the
/// transaction's age was no delay at all.)
#[tokio::test]
async fn a_delay_runs_from_the_send_in_a_long_transaction() {
    let pool = pool().await;
    let q = queue(&pool, "delayed", QueueAttributes::default()).await;
    let one_second = Duration::from_secs(1);
    let mut tx = pool.begin().await.unwrap();
    // Time passing inside the transaction is what this is about.
    sqlx::query("SELECT pg_sleep(1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let mut sent = vec![
        q.send_in(&mut tx, SendMessage::new("one").delay(one_second))
            .await
            .unwrap(),
    ];
    for batch in [
        vec![SendMessage::new("plain").delay(one_second)],
        vec![SendMessage::new("with id").dedup("d").delay(one_second)],
    ] {
        sent.extend(q.send_batch_in(&mut tx, batch).await.unwrap());
    }
    let begun: time::OffsetDateTime = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let not_before = begun + time::Duration::seconds(2);
    for s in &sent {
        let visible_at: time::OffsetDateTime =
            sqlx::query_scalar("SELECT visible_at FROM pgonce.queue_message WHERE id = $1")
                .bind(s.id.parse::<i64>().unwrap())
                .fetch_one(&pool)
                .await
                .unwrap();
        assert!(
            visible_at >= not_before,
            "{s:?}: {visible_at} < {not_before}"
        );
    }
}

/// A receive whose follow-up statement fails, step by step: s.fifo holds
/// a (due, its dead-letter group held), then, with `deliverable`, b, then
/// c (due). A holds t.fifo/g and t.fifo's queue row, so the move of c, in
/// the statement after the one that held a back, waits for A (seen in
/// pg_blocking_pids), and A cancels it. Returns what B's receive of
/// `max` returned.
async fn receive_whose_follow_up_is_cancelled(
    deliverable: bool,
    max: usize,
) -> pgonce::Result<Vec<Received>> {
    let db = fresh_database().await;
    let setup = db.pool(2).await.unwrap();
    pgonce::migrate(&setup).await.unwrap();
    let then: &[&str] = if deliverable { &["b"] } else { &[] };
    let (_, s) = heads_due_to_move_then(&setup, &["g"], then).await;
    s.send(SendMessage::new("c").group("k")).await.unwrap();
    sqlx::query("UPDATE pgonce.queue_message SET receive_count = 1 WHERE body = 'c'")
        .execute(&setup)
        .await
        .unwrap();
    let race = pgonce_testkit::Interleaving::new(db.options())
        .await
        .unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let sb = PgQueue::open(b.pool(), "s.fifo", fast_poll())
        .await
        .unwrap();
    let mut atx = a.pool().begin().await.unwrap();
    race.step(
        &a,
        "take t.fifo/g's group lock and t.fifo's queue row",
        sqlx::raw_sql(
            "SELECT pg_advisory_xact_lock(pgonce.lock_key('pgonce.queue/t.fifo', 'g'));
             SELECT 1 FROM pgonce.queue WHERE name = 't.fifo' FOR UPDATE;",
        )
        .execute(&mut *atx),
    )
    .await
    .unwrap()
    .unwrap();
    let waiting = race
        .step_blocks(&b, "receive s.fifo", async move {
            sb.receive(ReceiveRequest::up_to(max).visibility(Duration::from_secs(600)))
                .await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    race.step(
        &a,
        "cancel the statement waiting for A",
        sqlx::query(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
             WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))",
        )
        .execute(&mut *atx),
    )
    .await
    .unwrap()
    .unwrap();
    let outcome = waiting.resume().await.unwrap();
    atx.rollback().await.unwrap();
    outcome
}

/// A receive's later statement failing after an earlier one delivered:
/// the receive returns what was delivered (those leases are taken), not an
/// error that leaves them with nobody. With nothing delivered, the failure
/// is the receive's error, as a failing first statement's is.
#[tokio::test]
async fn a_receive_whose_follow_up_fails_returns_what_it_delivered_or_the_error() {
    let got = receive_whose_follow_up_is_cancelled(true, 2).await.unwrap();
    assert_eq!(bodies(&got), ["b"], "b's lease is the caller's");
    let refused = receive_whose_follow_up_is_cancelled(false, 1).await;
    assert!(
        matches!(refused, Err(Error::QueryCanceled { .. })),
        "{refused:?}"
    );
}

/// `statement_timeout` bounds a receive's wait (here for the messages'
/// table, which another transaction holds locked): the receive fails once
/// it runs out with the typed `QueryCanceled` (SQLSTATE 57014), not a bare
/// database error a caller cannot tell from a bug, and delivers nothing:
/// the message is received whole once the holder is gone.
#[tokio::test]
async fn statement_timeout_ends_a_receives_wait_with_a_typed_error() {
    let (db, setup) = database_with_queue("timed", QueueAttributes::default()).await;
    let q = PgQueue::open(&setup, "timed", fast_poll()).await.unwrap();
    q.send(SendMessage::new("m")).await.unwrap();
    let race = Interleaving::new(db.options()).await.unwrap();
    let (h, w) = (
        race.session("H").await.unwrap(),
        race.session("W").await.unwrap(),
    );
    w.set("statement_timeout", "2s").await.unwrap();
    let qw = PgQueue::open(w.pool(), "timed", fast_poll()).await.unwrap();
    let mut holder = h.pool().begin().await.unwrap();
    race.step(
        &h,
        "lock the messages' table",
        sqlx::query("LOCK TABLE pgonce.queue_message IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *holder),
    )
    .await
    .unwrap()
    .unwrap();
    let timeout = ("statement_timeout", Duration::from_secs(2));
    let waited = support::outcome_of_blocked_wait(&race, &w, "H", "receive", timeout, || {
        let qw = qw.clone();
        async move { qw.receive(ReceiveRequest::up_to(1)).await }
    })
    .await;
    let Err(Error::QueryCanceled { message }) = &waited else {
        panic!("{waited:?}");
    };
    assert!(message.contains("statement timeout"), "{message}");
    holder.rollback().await.unwrap();
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(bodies(&got), ["m"]);
    assert_eq!(
        got[0].receive_count, 1,
        "the canceled receive delivered nothing"
    );
}

/// A receive given up while its statement waits (for the messages' table,
/// which another transaction holds locked), on a standard and on a FIFO
/// queue. The statement was sent, so the server ran it once the holder was
/// gone: its messages were delivered to nobody, invisible for their whole
/// visibility timeout (an hour here), and the lost delivery counted toward
/// `max_receive_count` (in the FIFO queue, the group waited behind its
/// head all that time). They must be given back before the connection
/// serves anyone else: receivable at once, the lost delivery not counted.
#[tokio::test]
async fn a_receive_dropped_while_it_waits_gives_its_messages_back() {
    let hour = Duration::from_secs(3600);
    for (name, attributes, sent, receivable) in [
        (
            "given-back",
            QueueAttributes::default(),
            vec![SendMessage::new("m1"), SendMessage::new("m2")],
            vec!["m1", "m2"],
        ),
        (
            "given-back.fifo",
            QueueAttributes::fifo(),
            vec![
                SendMessage::new("m1").group("g"),
                SendMessage::new("m2").group("g"),
                SendMessage::new("n1").group("h"),
            ],
            vec!["m1", "n1"],
        ),
    ] {
        let (db, setup) = database_with_queue(name, attributes.visibility_timeout(hour)).await;
        let q = PgQueue::open(&setup, name, fast_poll()).await.unwrap();
        let race = Interleaving::new(db.options()).await.unwrap();
        let a = race.session("A").await.unwrap();
        let b = race.session("B").await.unwrap();
        let qb = PgQueue::open(b.pool(), name, fast_poll()).await.unwrap();
        // Prepared on B's connection while the queue is empty: the step
        // below is then the statement's own round trip, not its Parse.
        assert!(
            race.step(
                &b,
                "receive (nothing yet)",
                qb.receive(ReceiveRequest::up_to(10))
            )
            .await
            .unwrap()
            .unwrap()
            .is_empty()
        );
        q.send_batch(sent).await.unwrap();
        let mut tx_a = a.pool().begin().await.unwrap();
        race.step(
            &a,
            "lock the messages' table",
            sqlx::query("LOCK TABLE pgonce.queue_message IN EXCLUSIVE MODE").execute(&mut *tx_a),
        )
        .await
        .unwrap()
        .unwrap();
        let waiting = race
            .step_blocks(&b, "receive", async move {
                qb.receive(ReceiveRequest::up_to(10)).await
            })
            .await
            .unwrap();
        support::give_up_then_end(&race, waiting, (&a, tx_a.rollback()), &b).await;

        let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
        assert_eq!(
            bodies(&got),
            receivable,
            "{name}: the given-up receive's messages are receivable at once"
        );
        for message in &got {
            assert_eq!(
                message.receive_count, 1,
                "{name}: the delivery nobody saw is not counted: {message:?}"
            );
        }
    }
}

/// The give-back of a receive nobody waited for
/// (`receive_given_back.sql`), for a delivery the message has left: m was
/// delivered with no visibility, and delivered again since. The late
/// give-back touches nothing: m stays hidden with its new receiver, whose
/// receipt still deletes it.
#[tokio::test]
async fn a_give_back_leaves_a_message_delivered_again_since() {
    let (_db, setup) = database_with_queue("fenced", QueueAttributes::default()).await;
    let q = PgQueue::open(&setup, "fenced", fast_poll()).await.unwrap();
    q.send(SendMessage::new("m")).await.unwrap();
    let first = q
        .receive(ReceiveRequest::up_to(1).visibility(Duration::ZERO))
        .await
        .unwrap();
    let again = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(bodies(&again), ["m"]);
    // The receipt reads `<queue>:<id>:<generation>`.
    let parts: Vec<i64> = first[0]
        .receipt
        .0
        .split(':')
        .skip(1)
        .map(|part| part.parse().unwrap())
        .collect();
    let given_back: Vec<i64> =
        sqlx::query_scalar(include_str!("../src/queue/sql/receive_given_back.sql"))
            .bind("fenced")
            .bind(vec![parts[0]])
            .bind(vec![parts[1]])
            .fetch_all(&setup)
            .await
            .unwrap();
    assert!(given_back.is_empty(), "{given_back:?}");
    assert!(
        q.receive(ReceiveRequest::up_to(1))
            .await
            .unwrap()
            .is_empty(),
        "m stays with its second receiver"
    );
    q.delete(&again[0].receipt).await.unwrap();
}

/// A give-back (receive_given_back.sql) held at its start: its snapshot
/// taken, no row touched yet. A statement trigger on the messages' table
/// makes that statement alone (known by its text) wait for an advisory
/// lock that session T holds. B's receive was dropped while it waited for
/// A's lock on the messages' table and delivered to nobody, for
/// `visibility` (with none, its messages are receivable again at once),
/// while its give-back waits for T.
struct GiveBackHeld {
    race: Interleaving,
    b: pgonce_testkit::Session,
    t: pgonce_testkit::Session,
}

impl GiveBackHeld {
    async fn start(
        db: &pgonce_testkit::ScratchDatabase,
        setup: &PgPool,
        name: &str,
        visibility: Duration,
    ) -> Self {
        sqlx::raw_sql(
            "CREATE FUNCTION hold_give_back() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF current_query() LIKE '-- Deliveries a receive made for a caller%' THEN
                     PERFORM pg_advisory_xact_lock(4242);
                 END IF;
                 RETURN NULL;
             END $$;
             CREATE TRIGGER hold_give_back BEFORE UPDATE ON pgonce.queue_message
             FOR EACH STATEMENT EXECUTE FUNCTION hold_give_back();",
        )
        .execute(setup)
        .await
        .unwrap();
        let race = Interleaving::new(db.options()).await.unwrap();
        let a = race.session("A").await.unwrap();
        let b = race.session("B").await.unwrap();
        let t = race.session("T").await.unwrap();
        let qb = PgQueue::open(b.pool(), name, fast_poll()).await.unwrap();
        race.try_step(
            &t,
            "hold give-backs",
            sqlx::query("SELECT pg_advisory_lock(4242)").execute(t.pool()),
        )
        .await
        .unwrap();
        let mut tx_a = a.pool().begin().await.unwrap();
        race.try_step(
            &a,
            "lock the messages' table",
            sqlx::query("LOCK TABLE pgonce.queue_message IN EXCLUSIVE MODE").execute(&mut *tx_a),
        )
        .await
        .unwrap();
        let waiting = race
            .step_blocks(&b, "receive", async move {
                qb.receive(ReceiveRequest::up_to(10).visibility(visibility))
                    .await
            })
            .await
            .unwrap();
        assert_eq!(waiting.blocked_by(), ["A"]);
        waiting.cancel();
        race.try_step(&a, "end", tx_a.rollback()).await.unwrap();
        assert_eq!(
            race.wait_until_blocked(&b, "give back").await.unwrap(),
            ["T"]
        );
        GiveBackHeld { race, b, t }
    }

    /// Lets the give-back run, and waits until B's connection is free
    /// again: the give-back is over.
    async fn release(self) {
        let GiveBackHeld { race, b, t } = self;
        race.try_step(
            &t,
            "let give-backs run",
            sqlx::query("SELECT pg_advisory_unlock(4242)").execute(t.pool()),
        )
        .await
        .unwrap();
        assert_eq!(
            race.step(&b, "next use", support::leftovers(b.pool()))
                .await
                .unwrap(),
            support::Leftovers::NONE
        );
    }
}

/// A give-back that finds its message moved on since its snapshot: B's
/// dropped receive delivered m with no visibility (its first receive, of
/// one allowed); while the give-back waited, another receive moved m to
/// the dead-letter queue and a redrive brought it back, with a fresh
/// dead-letter count (receive_base = receive_count = 1). The give-back
/// re-checks the row it waited for and leaves m alone: m's next receive
/// is its second, counted. A give-back that judged its rows by its
/// snapshot (or without their generation) would take the redriven m's
/// count below its base (0, base 1): that receive would come back as m's
/// first (`receive_count` 1), a receive the dead-letter rule never counts.
#[tokio::test]
async fn a_held_give_back_leaves_a_message_moved_and_redriven_meanwhile() {
    let db = fresh_database().await;
    let setup = db.pool(2).await.unwrap();
    pgonce::migrate(&setup).await.unwrap();
    let dlq = PgQueue::create(
        &setup,
        "late-dlq",
        QueueAttributes::default(),
        PgQueueOptions::default(),
    )
    .await
    .unwrap();
    let q = PgQueue::create(
        &setup,
        "late",
        QueueAttributes::default()
            .visibility_timeout(Duration::from_secs(3600))
            .dead_letter("late-dlq", 1),
        fast_poll(),
    )
    .await
    .unwrap();
    q.send(SendMessage::new("m")).await.unwrap();
    let held = GiveBackHeld::start(&db, &setup, "late", Duration::ZERO).await;
    assert!(
        q.receive(ReceiveRequest::up_to(1))
            .await
            .unwrap()
            .is_empty(),
        "m, received once, moves"
    );
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    held.release().await;
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(bodies(&got), ["m"]);
    assert_eq!(got[0].receive_count, 2, "{:?}", got[0]);
    q.delete(&got[0].receipt).await.unwrap();
}

/// A give-back of two FIFO heads, one of them delivered again since: B's
/// dropped receive delivered m1 (group g, m2 behind it) and n1 (group h)
/// with no visibility, and while its give-back waited another receive
/// took one of them, x, for an hour. The give-back returns the other one
/// alone, uncounted, and leaves x with its receiver: x's group stays in
/// flight (x is not delivered twice at once, and m2 never passes m1), and
/// x's receipt still deletes it.
#[tokio::test]
async fn a_held_give_back_returns_only_the_fifo_heads_it_still_holds() {
    let (db, setup) = database_with_queue(
        "late.fifo",
        QueueAttributes::fifo().visibility_timeout(Duration::from_secs(3600)),
    )
    .await;
    let q = PgQueue::open(&setup, "late.fifo", fast_poll())
        .await
        .unwrap();
    q.send_batch(vec![
        SendMessage::new("m1").group("g"),
        SendMessage::new("m2").group("g"),
        SendMessage::new("n1").group("h"),
    ])
    .await
    .unwrap();
    let held = GiveBackHeld::start(&db, &setup, "late.fifo", Duration::ZERO).await;
    let taken = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(taken.len(), 1);
    let other = if taken[0].body == "m1" { "n1" } else { "m1" };
    held.release().await;
    let given_back = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(
        bodies(&given_back),
        [other],
        "{} is in flight with its second receiver",
        taken[0].body
    );
    assert_eq!(given_back[0].receive_count, 1, "{:?}", given_back[0]);
    q.delete(&taken[0].receipt).await.unwrap();
    q.delete(&given_back[0].receipt).await.unwrap();
    let after = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&after), ["m2"]);
}

/// A give-back wakes the receivers parked on its queue, as a send does:
/// P's long poll, re-polling once an hour, looked while the delivery
/// nobody saw hid m for an hour, and parked. Once the give-back ran, P
/// received m, as its first receive, woken for it, not at its poll.
#[tokio::test]
async fn a_give_back_wakes_a_long_poll_parked_behind_its_delivery() {
    let (db, setup) = database_with_queue("woken", QueueAttributes::default()).await;
    let hourly = PgQueueOptions {
        poll_interval: Duration::from_secs(3600),
        ..PgQueueOptions::default()
    };
    let q = PgQueue::open(&setup, "woken", hourly).await.unwrap();
    q.send(SendMessage::new("m")).await.unwrap();
    let hour = Duration::from_secs(3600);
    let held = GiveBackHeld::start(&db, &setup, "woken", hour).await;
    let parked = {
        let q = q.clone();
        tokio::spawn(async move { q.receive(ReceiveRequest::up_to(1).wait(hour)).await })
    };
    wait_until("a receive parked", || async { q.parked_receivers() > 0 }).await;
    held.release().await;
    let got = tokio::time::timeout(Duration::from_secs(60), parked)
        .await
        .expect("not woken by the give-back: it waits for its poll")
        .unwrap()
        .unwrap();
    assert_eq!(bodies(&got), ["m"]);
    assert_eq!(got[0].receive_count, 1, "{:?}", got[0]);
}

/// A receive dropped while its statement waits, whose statement then moved
/// a message to the dead-letter queue (received once already, of one
/// allowed) and delivered nothing: the receivers parked on the dead-letter
/// queue are woken for it, as a receive that returned wakes them, though
/// nobody took the receive's answer. P's long poll there re-polls once an
/// hour.
#[tokio::test]
async fn a_receive_dropped_while_it_waits_wakes_the_queue_it_moved_to() {
    let db = fresh_database().await;
    let setup = db.pool(2).await.unwrap();
    pgonce::migrate(&setup).await.unwrap();
    let hourly = PgQueueOptions {
        poll_interval: Duration::from_secs(3600),
        ..PgQueueOptions::default()
    };
    let dlq = PgQueue::create(
        &setup,
        "moved-dlq",
        QueueAttributes::default(),
        hourly.clone(),
    )
    .await
    .unwrap();
    let q = PgQueue::create(
        &setup,
        "moved",
        QueueAttributes::default().dead_letter("moved-dlq", 1),
        hourly,
    )
    .await
    .unwrap();
    q.send(SendMessage::new("m")).await.unwrap();
    let once = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    q.change_visibility(&once[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    let hour = Duration::from_secs(3600);
    let parked = {
        let dlq = dlq.clone();
        tokio::spawn(async move { dlq.receive(ReceiveRequest::up_to(1).wait(hour)).await })
    };
    wait_until("a receive parked", || async { dlq.parked_receivers() > 0 }).await;
    let support::HolderAndWaiter { race, a, b, tx_a } = support::a_holding(
        db.options(),
        "lock the messages' table",
        "LOCK TABLE pgonce.queue_message IN EXCLUSIVE MODE",
    )
    .await;
    let qb = PgQueue::open(b.pool(), "moved", fast_poll()).await.unwrap();
    let waiting = race
        .step_blocks(&b, "receive", async move {
            qb.receive(ReceiveRequest::up_to(1)).await
        })
        .await
        .unwrap();
    support::give_up_then_end(&race, waiting, (&a, tx_a.rollback()), &b).await;
    let got = tokio::time::timeout(Duration::from_secs(60), parked)
        .await
        .expect("not woken by the move: it waits for its poll")
        .unwrap()
        .unwrap();
    assert_eq!(bodies(&got), ["m"]);
}

/// A give-back that fails: B's backend ended (pg_terminate_backend) while
/// its give-back waited. Nothing of it is done: m keeps the delivery
/// nobody saw, counted (no visibility: it is receivable at once, its next
/// receive its second), and B's pool, whose one connection died under the
/// give-back, serves its next statement on a fresh one, with nothing left
/// open.
#[tokio::test]
async fn a_give_back_whose_connection_dies_leaves_the_delivery_as_it_was() {
    let (db, setup) = database_with_queue("cut", QueueAttributes::default()).await;
    let q = PgQueue::open(&setup, "cut", fast_poll()).await.unwrap();
    q.send(SendMessage::new("m")).await.unwrap();
    let held = GiveBackHeld::start(&db, &setup, "cut", Duration::ZERO).await;
    let ended: Vec<bool> = held
        .race
        .try_step(
            &held.t,
            "end the give-back's backend",
            sqlx::query_scalar(
                "SELECT pg_terminate_backend(pid) FROM pg_locks
                 WHERE locktype = 'advisory' AND objid = 4242 AND NOT granted
                   AND database = (SELECT oid FROM pg_database
                                   WHERE datname = current_database())",
            )
            .fetch_all(held.t.pool()),
        )
        .await
        .unwrap();
    assert_eq!(ended, [true]);
    held.release().await;
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(bodies(&got), ["m"]);
    assert_eq!(got[0].receive_count, 2, "{:?}", got[0]);
}

/// A run of heads a receive does not deliver costs it a few statements,
/// not one each: 200 heads due to move, their dead-letter groups held by a
/// sender, ahead of b. A receive of one looks twice as far at each
/// statement, so at most 9 statements hold heads back before it reaches b
/// (it took 200, the cost growing with the square of the run). Counted
/// from the metric each such statement records, on this thread.
#[tokio::test]
async fn a_run_of_held_heads_costs_a_receive_a_few_statements() {
    let pool = pool().await;
    let (t, s) = many_heads_due_to_move_then_b(&pool, 200).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(
        "SELECT count(pg_advisory_xact_lock(pgonce.lock_key('pgonce.queue/t.fifo', 'g' || i)))
         FROM generate_series(1, 200) AS i",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    // Counts the statements that recorded `pgonce_queue_held_back_total`.
    let statements = std::sync::atomic::AtomicU64::new(0);
    let recorder = support::OnCounter(|key: &metrics::Key| {
        if key.name() == "pgonce_queue_held_back_total" {
            statements.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        metrics::Counter::noop()
    });
    let got = {
        let _local = metrics::set_default_local_recorder(&recorder);
        s.receive(ReceiveRequest::up_to(1)).await.unwrap()
    };
    tx.rollback().await.unwrap();
    assert_eq!(bodies(&got), ["b"]);
    let held_back = statements.load(std::sync::atomic::Ordering::SeqCst);
    assert!(held_back <= 9, "{held_back} statements held heads back");
    assert_eq!(t.stats().await.unwrap().depth, 0, "none moved while held");
}

/// A receive looks past the heads it moves: 40 heads due to move ahead of
/// b, nothing holding their dead-letter groups. A receive of one moves
/// them all and delivers b (a move took the batch's only place, so each
/// receive moved one head and returned nothing).
#[tokio::test]
async fn a_receive_looks_past_the_heads_it_moves() {
    let pool = pool().await;
    let (t, s) = many_heads_due_to_move_then_b(&pool, 40).await;
    let got = s.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(bodies(&got), ["b"]);
    assert_eq!(t.stats().await.unwrap().depth, 40);
}

/// A standard queue's receive takes the earliest visible messages, even
/// when a statement that moved one looks again: d (due to move, visible
/// 30 s ago), then a (1 s ago) and b (10 s ago), in id order. A receive of
/// one moves d and delivers b, as it does without d (it delivered a: the
/// look-again capped its deliveries in id order).
#[tokio::test]
async fn a_receive_that_looks_again_still_takes_the_earliest_visible() {
    for with_due_head in [false, true] {
        let pool = pool().await;
        let (q, _dlq) = with_dead_letters(&pool).await;
        let due: &[(&str, i32, i32)] = if with_due_head { &[("d", 2, 30)] } else { &[] };
        for (body, count, ago) in due.iter().chain(&[("a", 0, 1), ("b", 0, 10)]) {
            sqlx::query(
                "INSERT INTO pgonce.queue_message (queue, body, visible_at, receive_count, generation)
                 VALUES ('jobs', $1, now() - $2 * interval '1 second', $3, $3)",
            )
            .bind(body)
            .bind(ago)
            .bind(count)
            .execute(&pool)
            .await
            .unwrap();
        }
        let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
        assert_eq!(
            bodies(&got),
            ["b"],
            "with a head due to move first: {with_due_head}"
        );
    }
}

/// A receive's first statement only delivers (receive_fate_lean.sql): a
/// head past its retention comes back undecided, and the full statement
/// that looks again deletes it and delivers the next. x, sent 5 days ago
/// (retention 4 days), then b: a receive of one returns b, and x is gone.
/// (Had the undecided head not been looked at again, the receive would
/// have returned nothing; delivered by the first statement, x.)
#[tokio::test]
async fn a_receive_of_one_deletes_an_expired_head_and_delivers_the_next() {
    let pool = pool().await;
    let q = queue(&pool, "old", QueueAttributes::default()).await;
    sqlx::query(
        "INSERT INTO pgonce.queue_message (queue, body, sent_at, visible_at)
         VALUES ('old', 'x', now() - interval '5 days', now() - interval '5 days')",
    )
    .execute(&pool)
    .await
    .unwrap();
    q.send(SendMessage::new("b")).await.unwrap();
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(bodies(&got), ["b"]);
    let left: Vec<String> =
        sqlx::query_scalar("SELECT body FROM pgonce.queue_message WHERE queue = 'old' ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(left, ["b"], "the expired head was deleted");
}

/// A receive of the largest batch whose first statement delivered nothing
/// looks again with the full statement, which decides what the first left
/// undecided. x, sent 5 days ago (retention 4 days), and d, received
/// twice (max_receive_count 2), are all the queue has visible; b is
/// delayed. A receive of MAX_BATCH deletes x and moves d. (Its follow-up
/// looked at as many messages as it could deliver, and a follow-up like
/// that ran the lean statement again: x and d came back undecided twice,
/// nothing was decided, and every receive of that size, a long poll's
/// looks included, did the same.)
#[tokio::test]
async fn a_receive_of_the_largest_batch_decides_what_its_first_statement_left() {
    let pool = pool().await;
    let (q, dlq) = with_dead_letters(&pool).await;
    sqlx::query(
        "INSERT INTO pgonce.queue_message (queue, body, sent_at, visible_at, receive_count, generation)
         VALUES ('jobs', 'x', now() - interval '5 days', now() - interval '5 days', 0, 0),
                ('jobs', 'd', now(), now() - interval '1 second', 2, 2)",
    )
    .execute(&pool)
    .await
    .unwrap();
    q.send(SendMessage::new("b").delay(Duration::from_secs(600)))
        .await
        .unwrap();
    let largest = 1000; // postgres.rs MAX_BATCH
    let got = q.receive(ReceiveRequest::up_to(largest)).await.unwrap();
    assert!(got.is_empty(), "delivered {:?}", bodies(&got));
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT queue || '/' || body FROM pgonce.queue_message
         WHERE body IN ('x', 'd') ORDER BY body",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        left,
        ["jobs-dlq/d"],
        "x expired and d moved to the dead-letter queue"
    );
    let moved = dlq.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(bodies(&moved), ["d"]);
}

/// A standard receive of every size, behind `k` messages past retention
/// and ahead of `max` live ones, for the shapes its statements take: the
/// lean first statement delivers the live ones it picks and leaves the
/// expired undecided; the follow-ups, looking twice as far each time up
/// to MAX_BATCH in all, decide them and fill the batch. When the expired
/// and the batch fit in that budget, one receive deletes every expired
/// message and fills its batch; past it, a receive still deletes some
/// (a long poll looks again at once, a worker receives again). The last
/// shape, the largest batch behind at least as many expired messages,
/// decided nothing before its follow-ups were all full statements.
#[tokio::test]
async fn a_receive_of_any_size_behind_expired_messages_decides_them_and_fills_its_batch() {
    let pool = pool().await;
    let largest = 1000; // postgres.rs MAX_BATCH
    let mut wrong = Vec::new();
    for max in [
        1usize, 2, 3, 4, 5, 7, 10, 100, 333, 334, 500, 501, 999, largest,
    ] {
        for k in [max - 1, max, max + 1, 2 * max] {
            let name = format!("s-{max}-{k}");
            let q = queue(&pool, &name, QueueAttributes::default()).await;
            // Visible in this order: the expired first, then the live.
            sqlx::query(
                "INSERT INTO pgonce.queue_message (queue, body, sent_at, visible_at)
                 SELECT $1, CASE WHEN i <= $2 THEN 'expired' ELSE 'live' END,
                        CASE WHEN i <= $2 THEN now() - interval '5 days' ELSE now() END,
                        now() - interval '1 day' + i * interval '1 ms'
                 FROM generate_series(1, $2 + $3) AS i",
            )
            .bind(&name)
            .bind(k as i64)
            .bind(max as i64)
            .execute(&pool)
            .await
            .unwrap();
            let got = q.receive(ReceiveRequest::up_to(max)).await.unwrap();
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pgonce.queue_message WHERE queue = $1 AND body = 'expired'",
            )
            .bind(&name)
            .fetch_one(&pool)
            .await
            .unwrap();
            let within_budget = k + max <= largest;
            let as_due = if within_budget {
                got.len() == max && left == 0
            } else {
                k == 0 || left < k as i64
            };
            if !as_due {
                wrong.push(format!(
                    "a receive of {max} behind {k} expired: {} delivered, {left} expired left",
                    got.len()
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// 5,000 messages of queue `old` past its retention (4 days).
async fn five_thousand_expired_in_old(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO pgonce.queue_message (queue, body, sent_at, visible_at)
         SELECT 'old', 'x' || i, now() - interval '5 days', now() - interval '5 days'
         FROM generate_series(1, 5000) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// A receive of one does no more work than a receive of the largest
/// batch: 5,000 messages past their retention, nothing else. It deletes
/// at most the first statement's one and MAX_BATCH more, and returns
/// nothing (it went on until none was left).
#[tokio::test]
async fn a_receive_of_one_does_the_work_of_one_batch_at_most() {
    let pool = pool().await;
    let q = queue(&pool, "old", QueueAttributes::default()).await;
    five_thousand_expired_in_old(&pool).await;
    assert!(
        q.receive(ReceiveRequest::up_to(1))
            .await
            .unwrap()
            .is_empty()
    );
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgonce.queue_message WHERE queue = 'old'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let limit = 1000; // the largest batch (postgres.rs MAX_BATCH)
    assert!(
        (5000 - left) <= 1 + limit,
        "one receive of one expired {} of 5,000",
        5000 - left
    );
}

/// A long poll behind a backlog larger than one receive clears looks on
/// at once: 5,000 expired messages, then b, and a poll interval of an
/// hour. A long poll of one returns b (it parked after each batch's worth
/// of expired messages, for the poll interval: here, to its deadline,
/// after at most three looks, and returned nothing).
#[tokio::test]
async fn a_long_poll_goes_on_through_a_backlog_without_parking() {
    let pool = pool().await;
    let q = PgQueue::create(
        &pool,
        "old",
        QueueAttributes::default(),
        PgQueueOptions {
            poll_interval: Duration::from_secs(3600),
            ..PgQueueOptions::default()
        },
    )
    .await
    .unwrap();
    five_thousand_expired_in_old(&pool).await;
    q.send(SendMessage::new("b")).await.unwrap();
    let got = q
        .receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(bodies(&got), ["b"]);
}

/// As [`heads_due_to_move_then`] for `n` heads (groups g1..gn, written
/// directly as received once and released), then b of its own group.
async fn many_heads_due_to_move_then_b(pool: &PgPool, n: i64) -> (PgQueue, PgQueue) {
    let t = queue(pool, "t.fifo", QueueAttributes::fifo()).await;
    let s = fifo_dead_lettering_at_second_receive(pool, "s.fifo", "t.fifo").await;
    sqlx::query(
        "INSERT INTO pgonce.queue_message
                (queue, body, group_id, visible_at, receive_count, generation, first_received_at)
         SELECT 's.fifo', 'due-g' || i, 'g' || i, now() - interval '1 second', 1, 1, now()
         FROM generate_series(1, $1) AS i",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
    s.send(SendMessage::new("b").group("b")).await.unwrap();
    (t, s)
}

/// A receive tries the dead-letter group lock only for the messages it
/// picked. 2,000 FIFO heads are due to move, with statistics from while
/// they were in flight, so the plan sorts the visible rows by id above the
/// scan and the LIMIT does not stop it. A lock tried in the pick's filter
/// was taken for all 2,000 (their senders then waited on the receive, and
/// once more heads were due than the shared lock table holds, every
/// receive failed with "out of shared memory"). Run as a prepared
/// statement under each plan mode, as sqlx runs it, in a transaction that
/// counts the locks it holds before rolling back.
#[tokio::test]
async fn a_receive_of_one_locks_only_the_dead_letter_group_it_moves_to() {
    let pool = pool().await;
    queue(&pool, "t.fifo", QueueAttributes::fifo()).await;
    fifo_dead_lettering_at_second_receive(&pool, "s.fifo", "t.fifo").await;
    sqlx::raw_sql(
        "ALTER TABLE pgonce.queue_message SET (autovacuum_enabled = false);
         INSERT INTO pgonce.queue_message
                (queue, body, group_id, visible_at, receive_count, generation, first_received_at)
         SELECT 's.fifo', 'm' || i, 'g' || i, now() + interval '1 hour', 1, 1, now()
         FROM generate_series(1, 2000) AS i;
         ANALYZE pgonce.queue_message;
         UPDATE pgonce.queue_message SET visible_at = now() - interval '1 second';",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    for plan_mode in ["force_custom_plan", "force_generic_plan"] {
        prepare_in_transaction(
            &mut conn,
            plan_mode,
            "text, bigint, bigint, bigint[], bigint",
            FIFO_RECEIVE,
        )
        .await;
        let fates: Vec<String> = sqlx::query_scalar("EXECUTE prepared('s.fifo', 1, NULL, '{}', 1)")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        let locks: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        roll_back_prepared(&mut conn).await;
        assert_eq!(
            (fates, locks),
            (vec!["dead_lettered".to_owned()], 1),
            "{plan_mode}: what a receive of one did, and the advisory locks it held"
        );
    }
}

/// A chain s.fifo -> d.fifo -> e.fifo, each dead-lettering at the second
/// receive. A message moved into d.fifo starts a fresh count there, so d
/// delivers it before moving it on (it used to move it on at once, and in
/// a cycle it bounced without ever being delivered). m1 goes s -> d -> e
/// and e's redrive brings it back to d, where it is d's own message; m2 of
/// the same group, dead-lettered from s into d behind it, is still
/// redriven back to s: only earlier dead letters hold a redrive back.
#[tokio::test]
async fn a_chain_of_dead_letter_queues_delivers_in_each_and_redrives_past_a_queues_own_message() {
    let pool = pool().await;
    let e = queue(&pool, "e.fifo", QueueAttributes::fifo()).await;
    let d = fifo_dead_lettering_at_second_receive(&pool, "d.fifo", "e.fifo").await;
    let s = fifo_dead_lettering_at_second_receive(&pool, "s.fifo", "d.fifo").await;
    s.send(SendMessage::new("m1").group("g")).await.unwrap();
    dead_letter_next(&s, "m1").await;
    dead_letter_next(&d, "m1").await;
    assert_eq!(e.redrive().await.unwrap(), 1, "m1 back to d.fifo");
    s.send(SendMessage::new("m2").group("g")).await.unwrap();
    dead_letter_next(&s, "m2").await;
    assert_eq!(d.redrive().await.unwrap(), 1, "m2 back to s.fifo");
    #[derive(sqlx::FromRow)]
    struct Placed {
        body: String,
        queue: String,
    }
    let placed: Vec<Placed> =
        sqlx::query_as("SELECT body, queue FROM pgonce.queue_message ORDER BY body")
            .fetch_all(&pool)
            .await
            .unwrap();
    let placed: Vec<(&str, &str)> = placed
        .iter()
        .map(|p| (p.body.as_str(), p.queue.as_str()))
        .collect();
    assert_eq!(placed, [("m1", "d.fifo"), ("m2", "s.fifo")]);
}

/// A redrive leaves a dead letter that a consumer of the dead-letter queue
/// has in flight, and the messages of its group behind it: moved, they ran
/// in the source queue while it was still in flight, and it came back
/// behind them. w, x of f.fifo's group g are dead-lettered in that order;
/// f-dlq.fifo delivers w; a redrive moves nothing. Once w is released, the
/// next redrive moves both, in their order.
#[tokio::test]
async fn a_redrive_keeps_a_group_behind_its_message_in_flight_in_the_dead_letter_queue() {
    let pool = pool().await;
    let (q, dlq, w) = group_dead_lettered_with_its_head_in_flight(&pool).await;
    assert_eq!(dlq.redrive().await.unwrap(), 0, "x stays behind w");
    assert!(
        q.receive(ReceiveRequest::up_to(10))
            .await
            .unwrap()
            .is_empty()
    );
    dlq.change_visibility(&w[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(dlq.redrive().await.unwrap(), 2);
    let order = one_at_a_time(&q, 2).await;
    assert_eq!(bodies(&order), ["w", "x"]);
}

/// The redrive's second statement checks its group's order again, on the
/// messages it locked: the first step read w and x of group g as movable,
/// then a consumer of the dead-letter queue took w. The move (run here
/// directly with the first step's ids, as `redrive` runs it) must leave
/// both, not move x ahead of w.
#[tokio::test]
async fn a_redrive_rechecks_its_groups_order_after_the_dead_letter_queue_delivers() {
    let pool = pool().await;
    group_dead_lettered_with_its_head_in_flight(&pool).await;
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM pgonce.queue_message WHERE queue = 'f-dlq.fifo' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let moved = sqlx::query(include_str!("../src/queue/sql/redrive.sql"))
        .bind("f-dlq.fifo")
        .bind(&ids)
        .bind(["f.fifo", "f.fifo"])
        .execute(&pool)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(
        moved, 0,
        "x moved while w is in flight in the dead-letter queue"
    );
}

/// What a receive statement did with one message.
#[derive(Debug, PartialEq, sqlx::FromRow)]
struct ReceiveOutcome {
    fate: String,
    body: Option<String>,
}

/// The redrive race at the level of statements: a FIFO receive whose
/// snapshot was taken before a redrive committed does not see the redriven
/// message, and so may deliver the group's next message. That must leave
/// the redriven one behind it, not ahead as its group's head.
/// The receive runs the statement `PgQueue::receive` runs, in a REPEATABLE
/// READ transaction whose snapshot is taken before the redrive: what a
/// READ COMMITTED receive sees when its statement starts just before the
/// redrive commits.
#[tokio::test]
async fn a_receive_from_before_a_redrive_and_one_after_deliver_one_message_of_the_group() {
    let pool = pool().await;
    let (q, dlq, _, m2) = fifo_head_dead_lettered(&pool, &["m1", "m2"]).await;
    q.change_visibility(&m2.receipt, Duration::ZERO)
        .await
        .unwrap();
    let mut early = pgonce::begin(&pool, IsolationLevel::RepeatableRead)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM pgonce.queue_message")
        .execute(&mut *early)
        .await
        .unwrap();
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    let delivered: Vec<ReceiveOutcome> = sqlx::query_as(FIFO_RECEIVE)
        .bind("f.fifo")
        .bind(10i64)
        .bind(None::<i64>)
        .bind(Vec::<i64>::new())
        .bind(10i64)
        .fetch_all(&mut *early)
        .await
        .unwrap();
    early.commit().await.unwrap();
    assert_eq!(
        delivered,
        [ReceiveOutcome {
            fate: "delivered".into(),
            body: Some("m2".into())
        }]
    );
    let after = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert!(
        after.is_empty(),
        "delivered while m2 of the same group is in flight: {:?}",
        bodies(&after)
    );
}

/// Step by step: session A sends `body` to group "g" of `queue` in an
/// open transaction; then session B runs `then` on its handle of
/// `b_queue`, which must wait for A (seen in pg_blocking_pids); A commits,
/// and B's result is returned.
async fn behind_a_send_in_flight<T, F>(
    db: &pgonce_testkit::ScratchDatabase,
    queue: &str,
    body: &str,
    b_queue: &str,
    then: impl FnOnce(PgQueue) -> F,
) -> pgonce::Result<T>
where
    T: Send + 'static,
    F: std::future::Future<Output = pgonce::Result<T>> + Send + 'static,
{
    let race = pgonce_testkit::Interleaving::new(db.options())
        .await
        .unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let qa = PgQueue::open(a.pool(), queue, fast_poll()).await.unwrap();
    let qb = PgQueue::open(b.pool(), b_queue, fast_poll()).await.unwrap();
    let mut tx = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(
        &a,
        &format!("send {body} to {queue}/g in tx"),
        qa.send_in(&mut tx, SendMessage::new(body).group("g")),
    )
    .await
    .unwrap()
    .unwrap();
    let waiting = race
        .step_blocks(&b, &format!("on {b_queue}"), then(qb))
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    race.step(&a, "commit", tx.commit()).await.unwrap().unwrap();
    waiting.resume().await.unwrap()
}

/// Receives and deletes `n` messages from `q`, checking that each receive
/// delivers exactly one (one message of a group in flight at a time);
/// returns them in order.
async fn one_at_a_time(q: &PgQueue, n: usize) -> Vec<Received> {
    let mut order = Vec::new();
    for _ in 0..n {
        let mut got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
        assert_eq!(got.len(), 1, "one at a time: {:?}", bodies(&got));
        q.delete(&got[0].receipt).await.unwrap();
        order.push(got.remove(0));
    }
    order
}

/// A redrive takes the FIFO group's lock before it places a message, as a
/// send does before it draws an id, step by step: A sends m3 to group g in
/// an open transaction; the redrive of m1 waits for A (seen in
/// pg_blocking_pids); once A commits, m1 goes behind m3. Without the wait,
/// m1's position was drawn before m3's id and committed first, so a
/// receive could take m1 as g's head while m3 was not yet visible, and
/// then m3 once it was, out of order.
#[tokio::test]
async fn a_redrive_waits_for_a_send_to_the_group_in_flight_and_goes_behind_it() {
    let db = fresh_database().await;
    let setup = db.pool(2).await.unwrap();
    pgonce::migrate(&setup).await.unwrap();
    let (q, _, _, m2) = fifo_head_dead_lettered(&setup, &["m1", "m2"]).await;
    q.delete(&m2.receipt).await.unwrap();
    let moved = behind_a_send_in_flight(&db, "f.fifo", "m3", "f-dlq.fifo", |dlq| async move {
        dlq.redrive().await
    })
    .await
    .unwrap();
    assert_eq!(moved, 1);
    let order = one_at_a_time(&q, 2).await;
    assert_eq!(bodies(&order), ["m3", "m1"]);
}

fn bodies(messages: &[Received]) -> Vec<&str> {
    messages.iter().map(|m| m.body.as_str()).collect()
}

#[tokio::test]
async fn a_dead_lettered_message_keeps_its_history() {
    let pool = pool().await;
    let (q, dlq) = with_dead_letters(&pool).await;
    let sent = q.send(SendMessage::new("poison")).await.unwrap();
    for _ in 0..2 {
        let m = q.receive(ReceiveRequest::up_to(1)).await.unwrap().remove(0);
        q.change_visibility(&m.receipt, Duration::ZERO)
            .await
            .unwrap();
    }
    assert!(
        q.receive(ReceiveRequest::up_to(1))
            .await
            .unwrap()
            .is_empty()
    );
    let now = q.history(&sent.id).await.unwrap().unwrap();
    assert_eq!(now.queue, "jobs-dlq");
    assert_eq!(now.history[0]["event"], "dead_lettered");
    assert_eq!(now.history[0]["from"], "jobs");
    assert_eq!(now.history[0]["receive_count"], 2);
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    let now = q.history(&sent.id).await.unwrap().unwrap();
    assert_eq!(now.queue, "jobs");
    assert_eq!(now.history[1]["event"], "redriven");
    // A fresh dead-letter budget after the redrive: two more receives.
    for _ in 0..2 {
        let m = q.receive(ReceiveRequest::up_to(1)).await.unwrap().remove(0);
        q.change_visibility(&m.receipt, Duration::ZERO)
            .await
            .unwrap();
    }
    assert!(
        q.receive(ReceiveRequest::up_to(1))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(q.stats().await.unwrap().dead_letter_depth, Some(1));

    // One being handled from the dead-letter queue stays there: a redrive
    // would hand it to a second consumer at once.
    let inspected = dlq.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(inspected.len(), 1);
    assert_eq!(dlq.redrive().await.unwrap(), 0, "in flight: not redriven");
    dlq.change_visibility(&inspected[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(dlq.redrive().await.unwrap(), 1);
}

#[tokio::test]
async fn dedup_within_the_window_returns_the_original_id() {
    let pool = pool().await;
    conformance_dedup_within_window(&queue(&pool, "q", QueueAttributes::default()).await).await;
    conformance_dedup_within_window(&queue(&pool, "f", QueueAttributes::fifo()).await).await;
}

#[tokio::test]
async fn dedup_window_expires() {
    let pool = pool().await;
    let window = Duration::from_millis(500);
    let q = queue(&pool, "q", QueueAttributes::default().dedup_window(window)).await;
    conformance_dedup_window_expires(&q, window).await;
}

#[tokio::test]
async fn concurrent_sends_with_one_dedup_id_enqueue_once() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let sends = (0..16).map(|i| {
        let q = q.clone();
        tokio::spawn(async move { q.send(SendMessage::new(format!("{i}")).dedup("same")).await })
    });
    let sent: Vec<_> = futures::future::join_all(sends)
        .await
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect();
    assert_eq!(sent.iter().filter(|s| !s.duplicate).count(), 1);
    assert!(sent.iter().all(|s| s.id == sent[0].id));
    assert_eq!(q.stats().await.unwrap().depth, 1);
}

#[tokio::test]
async fn a_long_poll_wakes_on_send_not_on_its_timer() {
    let pool = pool().await;
    let q = PgQueue::create(&pool, "q", QueueAttributes::default(), slow_poll())
        .await
        .unwrap();
    long_poll_wakes_on_send(&q).await;
}

/// The conformance check that a send wakes a long poll, on `q`: the send
/// goes once the receive is parked.
async fn long_poll_wakes_on_send(q: &PgQueue) {
    let parked = async {
        wait_until("a receive parked", || async { q.parked_receivers() > 0 }).await;
    };
    conformance_long_poll_wakes_on_send(q, parked).await;
}

/// `Listen::Pool` opens its listener with the pool's connect options, so
/// the pool's `after_connect` hook does not run on it; nothing it runs
/// needs what the hook sets. A pool whose hook points `search_path` at a
/// schema that does not exist and names its sessions: a long poll parked
/// on it (re-polling once a minute) is woken by a send all the same, and
/// the listening session is the connect options' `application_name`, not
/// the hook's.
#[tokio::test]
async fn a_pool_listener_needs_nothing_the_pools_hooks_set() {
    use sqlx::Executor;
    let db = fresh_database().await;
    pgonce::migrate(&db.pool(1).await.unwrap()).await.unwrap();
    let hooked = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET search_path TO no_such_schema; SET application_name = 'hooked'")
                    .await?;
                Ok(())
            })
        })
        .connect_with(db.options().application_name("from-options"))
        .await
        .unwrap();
    let q = PgQueue::create(&hooked, "q", QueueAttributes::default(), slow_poll())
        .await
        .unwrap();
    long_poll_wakes_on_send(&q).await;
    let listening: Vec<String> = sqlx::query_scalar(
        "SELECT application_name FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_all(&hooked)
    .await
    .unwrap();
    assert_eq!(listening, ["from-options"]);
}

/// Receivers of one handle family parked in long polls, each for one
/// message, for an hour on a [`no_poll`] handle: within a test only a wake
/// ends one.
async fn parked_family(
    pool: &PgPool,
    receivers: usize,
) -> (PgQueue, Vec<tokio::task::JoinHandle<usize>>) {
    let q = PgQueue::create(pool, "q", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    let waiting = (0..receivers)
        .map(|_| {
            let q = q.clone();
            tokio::spawn(async move {
                let request = ReceiveRequest::up_to(1).wait(LONG_POLL);
                q.receive(request).await.unwrap().len()
            })
        })
        .collect();
    wait_until("every receive parked", || async {
        q.parked_receivers() >= receivers
    })
    .await;
    (q, waiting)
}

/// A notification wakes one parked receiver of the family, and one that
/// fills its batch wakes the next: a burst of as many messages as there
/// are receivers reaches every one of them, each parked for an hour, so
/// woken (the minute is a failsafe, not a measure). (Waking one and
/// nothing more left all but the first waiting out their wait.)
#[tokio::test]
async fn a_burst_wakes_as_many_parked_receivers_as_it_has_messages() {
    let pool = pool().await;
    let (q, waiting) = parked_family(&pool, 4).await;
    q.send_batch((0..4).map(|i| SendMessage::new(format!("{i}"))).collect())
        .await
        .unwrap();
    for receiver in waiting {
        let got = tokio::time::timeout(Duration::from_secs(60), receiver)
            .await
            .expect("not woken by the burst: it waits for its hour");
        assert_eq!(got.unwrap(), 1, "every receiver got a message");
    }
}

/// One message wakes one parked receiver, not the whole family: the
/// others stay parked and do not look, where waking every receiver sent
/// all of them to an empty receive for each send. The runtime is
/// single-threaded, so the thread-local recorder sees every receive, and a
/// receiver woken with the winner has looked by the time it has parked
/// again. The winner, having filled its batch of one, wakes one more:
/// at most one empty look.
#[tokio::test(flavor = "current_thread")]
async fn one_send_wakes_one_parked_receiver_not_the_family() {
    use std::sync::atomic::Ordering;
    let pool = pool().await;
    let (empty, recorder) = support::count_of("pgonce_queue_empty_receives_total");
    let _local = metrics::set_default_local_recorder(&recorder);
    let (q, mut waiting) = parked_family(&pool, 4).await;
    let looked_before = empty.load(Ordering::SeqCst);
    q.send(SendMessage::new("one")).await.unwrap();
    let mut got = 0;
    while got == 0 {
        let (done, _, rest) = futures::future::select_all(waiting).await;
        got = done.unwrap();
        waiting = rest;
    }
    wait_until("3 receives parked", || async { q.parked_receivers() >= 3 }).await;
    let looked = empty.load(Ordering::SeqCst) - looked_before;
    assert!(looked <= 1, "{looked} parked receivers looked in vain");
    for receiver in waiting {
        receiver.abort();
    }
}

/// A FIFO head due to move to its dead-letter queue while a sender holds
/// its group there (an open transaction that sent to the dead-letter
/// queue's group): a long poll holds it back once and parks. It does not
/// wake itself to look again, over and over, for as long as the sender's
/// transaction stays open (each look that held a message back used to
/// notify, and the notification woke the receiver that sent it).
#[tokio::test]
async fn a_held_back_head_does_not_wake_its_own_receiver_again() {
    use std::sync::atomic::Ordering;
    let pool = pool().await;
    let (held, recorder) = support::count_of("pgonce_queue_held_back_total");
    let _local = metrics::set_default_local_recorder(&recorder);
    let (q, dlq) = dead_lettering_at_second_receive(
        &pool,
        "f.fifo",
        "d.fifo",
        QueueAttributes::fifo(),
        slow_poll(),
    )
    .await;
    // Set up through a handle that does not notify, so that no
    // notification of the setup reaches the long poll below.
    let quiet = PgQueueOptions {
        notify: false,
        ..slow_poll()
    };
    let setup = PgQueue::open(&pool, "f.fifo", quiet).await.unwrap();
    setup.send(SendMessage::new("w").group("g")).await.unwrap();
    let w = setup.receive(ReceiveRequest::up_to(1)).await.unwrap();
    setup
        .change_visibility(&w[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    let mut sender = pool.begin().await.unwrap();
    dlq.send_in(&mut sender, SendMessage::new("v").group("g"))
        .await
        .unwrap();
    // The wait is what a spinning receive fills with looks; one that parks
    // looks once whatever the machine's speed (its poll is 60 s away).
    let got = q
        .receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(2)))
        .await
        .unwrap();
    assert!(got.is_empty());
    // Once as it starts, once more as its wait ends.
    let looks = held.load(Ordering::SeqCst);
    assert!(looks <= 2, "held back {looks} times in one long poll");
    sender.commit().await.unwrap();
    // Once the sender is gone the head moves at the next look.
    assert!(
        q.receive(ReceiveRequest::up_to(1))
            .await
            .unwrap()
            .is_empty()
    );
    let moved = dlq.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(
        bodies(&moved),
        ["v"],
        "the sender's message first; w behind it"
    );
}

/// Never polls within a test: a long poll of such a handle ends with a
/// notification or at the end of its wait.
fn no_poll() -> PgQueueOptions {
    PgQueueOptions {
        poll_interval: Duration::from_secs(3600),
        ..PgQueueOptions::default()
    }
}

/// One receiver of `q`'s family (a [`no_poll`] handle) parked in a long
/// poll of an hour for up to ten messages.
async fn parked_receiver(q: &PgQueue) -> tokio::task::JoinHandle<Vec<pgonce::Received>> {
    parked_receiver_of(q, 10).await
}

/// [`parked_receiver`], for up to `max` messages.
async fn parked_receiver_of(
    q: &PgQueue,
    max: usize,
) -> tokio::task::JoinHandle<Vec<pgonce::Received>> {
    // A receive that failed before it parked ends its task: say why rather
    // than wait for a park that never comes.
    spawned_until_parked(q, max)
        .await
        .unwrap_or_else(|ended| panic!("the receiver ended before it parked: {ended:?}"))
}

/// A receiver of `q`'s family, a long poll of an hour for up to `max`
/// messages, once it has parked; or how its task ended, if it ended first.
async fn spawned_until_parked(
    q: &PgQueue,
    max: usize,
) -> Result<
    tokio::task::JoinHandle<Vec<pgonce::Received>>,
    Result<Vec<pgonce::Received>, tokio::task::JoinError>,
> {
    let parked_before = q.parked_receivers();
    let receiver = {
        let q = q.clone();
        tokio::spawn(async move {
            let request = ReceiveRequest::up_to(max).wait(Duration::from_secs(3600));
            q.receive(request).await.unwrap()
        })
    };
    let deadline = tokio::time::Instant::now() + FAILSAFE;
    while q.parked_receivers() == parked_before {
        if receiver.is_finished() {
            return Err(receiver.await);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited two minutes for a receiver to park or end"
        );
        tokio::task::yield_now().await;
    }
    Ok(receiver)
}

/// What the receiver `parked_receiver` (or `long_poll`) started got. It
/// returns only when woken, by a notification or a message becoming
/// visible; the minute is a failsafe, not a measure.
async fn delivered(
    receiver: tokio::task::JoinHandle<Vec<pgonce::Received>>,
    by: &str,
) -> Vec<pgonce::Received> {
    tokio::time::timeout(Duration::from_secs(60), receiver)
        .await
        .unwrap_or_else(|_| panic!("not woken by {by}: it waits for its poll"))
        .unwrap()
}

/// The bodies of what [`delivered`] says.
async fn woken(receiver: tokio::task::JoinHandle<Vec<pgonce::Received>>, by: &str) -> Vec<String> {
    let got = delivered(receiver, by).await;
    got.into_iter().map(|m| m.body).collect()
}

/// Deleting a FIFO group's head in flight makes the next message its
/// group's head, receivable at once: a receiver parked in a long poll is
/// woken for it, as for a send, one at a time or in a batch. It used to
/// wait for its poll interval, so a group's backlog drained at one message
/// per poll interval behind parked receivers.
async fn deleting_a_fifo_head_wakes_a_parked_receiver(batch: bool) {
    let pool = pool().await;
    let f = PgQueue::create(&pool, "f.fifo", QueueAttributes::fifo(), no_poll())
        .await
        .unwrap();
    for body in ["a", "b"] {
        f.send(SendMessage::new(body).group("g")).await.unwrap();
    }
    let a = f.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&a), ["a"]);
    let receiver = parked_receiver(&f).await;
    if batch {
        let stale = f.delete_batch(&[a[0].receipt.clone()]).await.unwrap();
        assert!(stale.is_empty());
    } else {
        f.delete(&a[0].receipt).await.unwrap();
    }
    assert_eq!(woken(receiver, "the head's delete").await, ["b"]);
}

#[tokio::test]
async fn deleting_a_fifo_head_wakes_a_receiver_parked_for_the_next() {
    deleting_a_fifo_head_wakes_a_parked_receiver(false).await;
}

#[tokio::test]
async fn deleting_a_fifo_head_in_a_batch_wakes_a_receiver_parked_for_the_next() {
    deleting_a_fifo_head_wakes_a_parked_receiver(true).await;
}

/// Receives `q`'s one message, "poison", and hands it back; parks a
/// receiver on `dlq`; then receives `q` again, which moves the message to
/// its dead-letter queue (a `max_receive_count` of 1) and delivers nothing.
/// Returns the parked receiver.
async fn moved_under_a_parked_receiver(
    q: &PgQueue,
    dlq: &PgQueue,
) -> tokio::task::JoinHandle<Vec<pgonce::Received>> {
    let first = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&first), ["poison"]);
    q.change_visibility(&first[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    let receiver = parked_receiver(dlq).await;
    assert!(
        q.receive(ReceiveRequest::up_to(10))
            .await
            .unwrap()
            .is_empty(),
        "received once already: moved, not delivered"
    );
    receiver
}

/// A receive that moves a message to the dead-letter queue wakes a
/// receiver parked there, as a send to that queue would: the message is
/// receivable there at once. The receiver parked on the dead-letter queue
/// (a [`no_poll`] handle, an hour's wait) used to sleep to its poll
/// interval past it ([`delivered`] fails it after a minute).
async fn a_dead_letter_move_wakes_a_receiver_parked_on_the_dead_letter_queue(fifo: bool) {
    let pool = pool().await;
    let (source, dead, attributes) = if fifo {
        ("f.fifo", "f-dlq.fifo", QueueAttributes::fifo())
    } else {
        ("s", "s-dlq", QueueAttributes::default())
    };
    let dlq = PgQueue::create(&pool, dead, attributes.clone(), no_poll())
        .await
        .unwrap();
    let q = PgQueue::create(&pool, source, attributes.dead_letter(dead, 1), no_poll())
        .await
        .unwrap();
    let message = SendMessage::new("poison");
    q.send(if fifo { message.group("g") } else { message })
        .await
        .unwrap();
    let receiver = moved_under_a_parked_receiver(&q, &dlq).await;
    assert_eq!(woken(receiver, "the dead-letter move").await, ["poison"]);
}

#[tokio::test]
async fn a_dead_letter_move_wakes_a_receiver_parked_on_the_dead_letter_queue_standard() {
    a_dead_letter_move_wakes_a_receiver_parked_on_the_dead_letter_queue(false).await;
}

#[tokio::test]
async fn a_dead_letter_move_wakes_a_receiver_parked_on_the_dead_letter_queue_fifo() {
    a_dead_letter_move_wakes_a_receiver_parked_on_the_dead_letter_queue(true).await;
}

/// A dead-letter move wakes the receivers of the dead-letter queue the
/// move went to, even when the queue's redrive policy changes (`create`
/// of the existing queue) between the receive's commit and its
/// notification: to another dead-letter queue, or to none. The
/// notification used to read the queue's row again after the commit, and
/// woke the new dead-letter queue, or nobody, while the message waited in
/// the old one for its receivers' poll interval.
///
/// Driven step by step: the source's handle is on a pool of one whose
/// `before_acquire` changes the policy at the first acquire that finds the
/// message moved, the one the wake makes after the receive's statement
/// committed and its connection went back.
async fn a_dead_letter_move_wakes_the_queue_it_moved_to_when_the_policy_changed_after(
    changed_to: Option<&'static str>,
) {
    let (db, pool) = fresh_migrated_database(20, pgonce::migrate).await;
    let dead = "s-dlq";
    let dlq = PgQueue::create(&pool, dead, QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    PgQueue::create(&pool, "s-dlq-2", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    PgQueue::create(
        &pool,
        "s",
        QueueAttributes::default().dead_letter(dead, 1),
        no_poll(),
    )
    .await
    .unwrap();
    let after = match changed_to {
        Some(other) => QueueAttributes::default().dead_letter(other, 1),
        None => QueueAttributes::default(),
    };
    let changed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let source_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .before_acquire({
            let changed = changed.clone();
            let pool = pool.clone();
            move |conn, _| {
                let changed = changed.clone();
                let pool = pool.clone();
                let after = after.clone();
                Box::pin(async move {
                    if changed.load(std::sync::atomic::Ordering::SeqCst) {
                        return Ok(true);
                    }
                    let moved: bool = sqlx::query_scalar(
                        "SELECT EXISTS (SELECT 1 FROM pgonce.queue_message WHERE queue = $1)",
                    )
                    .bind(dead)
                    .fetch_one(&mut *conn)
                    .await?;
                    if moved {
                        PgQueue::create(&pool, "s", after, no_poll())
                            .await
                            .expect("the policy changed");
                        changed.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    Ok(true)
                })
            }
        })
        .connect_with(db.options())
        .await
        .unwrap();
    let q = PgQueue::open(&source_pool, "s", no_poll()).await.unwrap();
    q.send(SendMessage::new("poison")).await.unwrap();
    let receiver = moved_under_a_parked_receiver(&q, &dlq).await;
    assert_eq!(
        woken(receiver, "the dead-letter move").await,
        ["poison"],
        "policy changed to {changed_to:?}"
    );
    // The wake took the pool's one connection after the move committed,
    // so the policy had changed by the time it was sent.
    assert!(
        changed.load(std::sync::atomic::Ordering::SeqCst),
        "the policy was changed after the move"
    );
}

#[tokio::test]
async fn a_dead_letter_move_wakes_the_queue_it_moved_to_when_the_policy_changed_after_to_another() {
    a_dead_letter_move_wakes_the_queue_it_moved_to_when_the_policy_changed_after(Some("s-dlq-2"))
        .await;
}

#[tokio::test]
async fn a_dead_letter_move_wakes_the_queue_it_moved_to_when_the_policy_changed_after_to_none() {
    a_dead_letter_move_wakes_the_queue_it_moved_to_when_the_policy_changed_after(None).await;
}

/// A release (a visibility timeout of zero) makes the message receivable
/// at once: a parked receiver is woken for it.
#[tokio::test]
async fn a_release_wakes_a_parked_receiver() {
    let pool = pool().await;
    let q = PgQueue::create(&pool, "s", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    q.send(SendMessage::new("r")).await.unwrap();
    let r = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    let receiver = parked_receiver(&q).await;
    q.change_visibility(&r[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(woken(receiver, "the release").await, ["r"]);
}

/// A redrive moves messages back to their source queue: a receiver parked
/// on the source queue is woken for them.
#[tokio::test]
async fn a_redrive_wakes_a_receiver_parked_on_the_source_queue() {
    let pool = pool().await;
    let (q, dlq) =
        dead_lettering_at_second_receive(&pool, "s", "d", QueueAttributes::default(), no_poll())
            .await;
    q.send(SendMessage::new("m")).await.unwrap();
    dead_letter_next(&q, "m").await;
    assert_eq!(dlq.stats().await.unwrap().depth, 1, "m was dead-lettered");
    let receiver = parked_receiver(&q).await;
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    assert_eq!(woken(receiver, "the redrive").await, ["m"]);
}

/// How a woken receiver goes without taking what woke it.
#[derive(Clone, Copy)]
enum Lost {
    /// Its caller drops it (a timeout, a `select!`, a worker shutting
    /// down).
    Dropped,
    /// Its look fails.
    Failed,
}

/// A pool of one connection on `db`, for a test to hold (a family's
/// LISTEN connection is one of its own, outside the pool), given up on
/// after 2 s.
async fn pool_of_one(db: &pgonce_testkit::ScratchDatabase) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(db.options())
        .await
        .unwrap()
}

/// Makes a woken receiver waiting for a connection go without looking, as
/// `lost` says.
async fn lose(receiver: tokio::task::JoinHandle<pgonce::Result<usize>>, lost: Lost) {
    match lost {
        Lost::Dropped => {
            receiver.abort();
            assert!(receiver.await.unwrap_err().is_cancelled());
        }
        Lost::Failed => {
            let failed = receiver.await.unwrap();
            assert!(failed.is_err(), "no connection to look on: {failed:?}");
        }
    }
}

/// Two receivers of one family parked, each for one message; a send wakes
/// the first, which is held before it looks (its pool has no connection
/// free) and then `lost`. The other, parked for an hour on a [`no_poll`]
/// handle, takes the message (the minute is a failsafe, not a measure):
/// the wake the first consumed is passed on, not lost with it while the
/// message sits visible.
async fn a_woken_receiver_that_does_not_look_passes_the_wake_on(lost: Lost) {
    let (db, pool) = fresh_migrated_database(20, pgonce::migrate).await;
    let small = pool_of_one(&db).await;
    let q = PgQueue::create(&small, "q", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    let receive = |q: PgQueue| {
        tokio::spawn(async move {
            let request = ReceiveRequest::up_to(1).wait(LONG_POLL);
            q.receive(request).await.map(|r| r.len())
        })
    };
    // One after the other: a notification wakes the oldest waiter
    // (`Notify::notify_one`), so the first.
    let first = receive(q.clone());
    wait_until("a receive parked", || async { q.parked_receivers() > 0 }).await;
    let second = receive(q.clone());
    wait_until("2 receives parked", || async { q.parked_receivers() >= 2 }).await;
    let held = small.acquire().await.unwrap();
    let sender = PgQueue::open(&pool, "q", PgQueueOptions::default())
        .await
        .unwrap();
    sender.send(SendMessage::new("one")).await.unwrap();
    wait_until("all but one parked receive woken", || async {
        q.parked_receivers() <= 1
    })
    .await;
    lose(first, lost).await;
    drop(held);
    let got = tokio::time::timeout(Duration::from_secs(60), second)
        .await
        .expect("not woken by the wake passed on: it waits for its hour");
    assert_eq!(got.unwrap().unwrap(), 1, "the other took it");
}

#[tokio::test]
async fn a_woken_receiver_dropped_before_it_looks_passes_the_wake_on() {
    a_woken_receiver_that_does_not_look_passes_the_wake_on(Lost::Dropped).await;
}

#[tokio::test]
async fn a_woken_receiver_whose_look_fails_passes_the_wake_on() {
    a_woken_receiver_that_does_not_look_passes_the_wake_on(Lost::Failed).await;
}

#[tokio::test]
async fn a_long_poll_without_a_send_waits_its_time() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let started = std::time::Instant::now();
    let got = q
        .receive(ReceiveRequest::up_to(1).wait(Duration::from_millis(700)))
        .await
        .unwrap();
    assert!(got.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(700));
}

#[tokio::test]
async fn shutdown_finishes_in_flight_work_and_receives_nothing_more() {
    let pool = pool().await;
    conformance_shutdown(&queue(&pool, "q", QueueAttributes::default()).await).await;
}

#[tokio::test]
async fn a_shutdown_during_a_long_poll_leaves_later_messages_receivable() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let parked = async {
        wait_until("a receive parked", || async { q.parked_receivers() > 0 }).await;
    };
    conformance_shutdown_during_a_long_poll(&q, parked).await;
}

#[tokio::test]
async fn a_shutdown_after_a_redelivery_leaves_the_other_delivery_alone() {
    let pool = pool().await;
    conformance_shutdown_after_a_redelivery(&queue(&pool, "q", QueueAttributes::default()).await)
        .await;
}

#[tokio::test]
async fn a_failure_after_a_redelivery_leaves_the_other_delivery_alone() {
    let pool = pool().await;
    conformance_failure_after_a_redelivery(&queue(&pool, "q", QueueAttributes::default()).await)
        .await;
}

#[tokio::test]
async fn a_heartbeat_after_a_redelivery_leaves_the_other_delivery_alone() {
    let pool = pool().await;
    conformance_heartbeat_after_a_redelivery(&queue(&pool, "q", QueueAttributes::default()).await)
        .await;
}

#[tokio::test]
async fn deliveries_state_their_visibility() {
    let pool = pool().await;
    conformance_deliveries_state_their_visibility(&queue(&pool, "q", one_second()).await).await;
}

/// A message delivered to a parked long poll states the look that
/// delivered it as its request ([`pgonce::Received::requested_at`]), not
/// the receive's start: its visibility is counted from there, the wait
/// before it not taken off. Step by step: the receive parks (seen on the
/// handle's counter, [`parked_receiver`]), then the message is sent, and
/// the notification wakes the receive to look again.
#[tokio::test]
async fn a_long_poll_counts_its_delivery_from_the_look_that_made_it() {
    let pool = pool().await;
    let q = PgQueue::create(&pool, "q", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    let receiver = parked_receiver(&q).await;
    let parked = std::time::Instant::now();
    q.send(SendMessage::new("m")).await.unwrap();
    let got = delivered(receiver, "the send").await;
    assert_eq!(got.len(), 1, "the message sent");
    assert!(
        got[0].requested_at >= parked,
        "requested {:?} before the receive was seen parked: the long poll's wait is counted \
         as the delivery's",
        parked - got[0].requested_at
    );
}

/// A long poll of up to ten messages for `wait`, on a [`no_poll`] handle:
/// within a test only a notification, a message becoming visible or the
/// end of `wait` ends it.
fn long_poll(q: &PgQueue, wait: Duration) -> tokio::task::JoinHandle<Vec<Received>> {
    let q = q.clone();
    tokio::spawn(async move {
        q.receive(ReceiveRequest::up_to(10).wait(wait))
            .await
            .unwrap()
    })
}

/// How long a long poll of [`messages_becoming_visible_end_a_long_poll`]
/// waits: an hour, as long as its poll interval, so that within a test it
/// ends only when woken ([`delivered`] fails it after a minute).
const LONG_POLL: Duration = Duration::from_secs(3600);

/// A message that becomes visible during a long poll ends it, though no
/// notification announces it: the look that found nothing learnt when the
/// queue's next message becomes visible (receive_next_visible.sql), and the long
/// poll wakes then. It used to sleep to its poll interval and the end of
/// its wait (an hour here).
#[tokio::test]
async fn messages_becoming_visible_end_a_long_poll() {
    let pool = pool().await;
    let q = PgQueue::create(&pool, "s", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    let short = Duration::from_millis(300);

    // Sent with a delay before the long poll began.
    q.send(SendMessage::new("delayed").delay(short))
        .await
        .unwrap();
    let got = delivered(long_poll(&q, LONG_POLL), "a delay running out").await;
    assert_eq!(bodies(&got), ["delayed"]);
    q.delete(&got[0].receipt).await.unwrap();

    // Sent with a delay while it was parked: the send's notification
    // wakes it to find nothing yet, and it waits for the delay.
    let receiver = parked_receiver(&q).await;
    q.send(SendMessage::new("delayed while parked").delay(short))
        .await
        .unwrap();
    let got = delivered(receiver, "a delay running out while parked").await;
    assert_eq!(bodies(&got), ["delayed while parked"]);
    q.delete(&got[0].receipt).await.unwrap();

    // A lease running out: delivered for 300 ms, neither deleted nor
    // handed back.
    q.send(SendMessage::new("leased")).await.unwrap();
    let first = q
        .receive(ReceiveRequest::up_to(1).visibility(short))
        .await
        .unwrap();
    assert_eq!(bodies(&first), ["leased"]);
    let got = delivered(long_poll(&q, LONG_POLL), "a lease running out").await;
    assert_eq!(
        (bodies(&got), got.first().map(|m| m.receive_count)),
        (vec!["leased"], Some(2))
    );
    q.delete(&got[0].receipt).await.unwrap();

    // Handed back for 300 ms while the long poll was parked until the end
    // of the hour-long lease it had seen.
    q.send(SendMessage::new("handed back")).await.unwrap();
    let first = q
        .receive(ReceiveRequest::up_to(1).visibility(Duration::from_secs(3600)))
        .await
        .unwrap();
    let receiver = parked_receiver(&q).await;
    q.change_visibility(&first[0].receipt, short).await.unwrap();
    let got = delivered(receiver, "a hand-back running out").await;
    assert_eq!(bodies(&got), ["handed back"]);
}

/// A send, and a hand-back, through a handle dropped as soon as it
/// returns (a handle opened for one call, a process about to exit) still
/// wake a receiver parked on another handle family. The notification is
/// sent after the commit by the family's notifier task, which dropping
/// the family's last handle aborted before it ran (on this
/// single-threaded runtime, always): the receiver slept to its poll
/// interval.
#[tokio::test]
async fn a_handle_dropped_after_its_call_still_wakes_parked_receivers() {
    let pool = pool().await;
    let q = PgQueue::create(&pool, "s", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    let receiver = parked_receiver(&q).await;
    let once = PgQueue::open(&pool, "s", no_poll()).await.unwrap();
    once.send(SendMessage::new("m")).await.unwrap();
    drop(once);
    let got = delivered(receiver, "a send through a dropped handle").await;
    assert_eq!(bodies(&got), ["m"]);

    let receiver = parked_receiver(&q).await;
    let once = PgQueue::open(&pool, "s", no_poll()).await.unwrap();
    once.change_visibility(&got[0].receipt, Duration::ZERO)
        .await
        .unwrap();
    drop(once);
    let got = delivered(receiver, "a hand-back through a dropped handle").await;
    assert_eq!(bodies(&got), ["m"]);
}

/// How many empty looks a long poll of `wait` on `q` (a [`no_poll`]
/// handle) makes, on this single-threaded runtime's `empty` counter. One
/// that could only look once, its first look over after its wait, says
/// [`TooSlow`].
async fn empty_looks_in_a_long_poll(
    q: &PgQueue,
    empty: &std::sync::atomic::AtomicU64,
    wait: Duration,
) -> Result<u64, TooSlow> {
    let before = empty.load(std::sync::atomic::Ordering::SeqCst);
    let got = q
        .receive(ReceiveRequest::up_to(10).wait(wait))
        .await
        .unwrap();
    assert!(got.is_empty(), "nothing to receive");
    match empty.load(std::sync::atomic::Ordering::SeqCst) - before {
        1 => Err(TooSlow("the long poll's first look ended after its wait")),
        looks => Ok(looks),
    }
}

/// What a long poll's wake for the queue's next visible message must not
/// do: wake for a message of another queue, or again and again for
/// messages that are visible but not receivable. A delay running out on
/// another queue, and a FIFO group's followers (visible, behind a head in
/// flight for an hour), leave a parked long poll alone: it looks as it
/// starts and as its wait ends, twice, whatever the machine's speed (its
/// poll interval is an hour away). Counted, not timed: the wait is one and
/// a half units, the other queue's delay three tenths of one
/// ([`with_delays_long_enough`]), and a long poll whose first look took
/// all its wait is run again with longer ones.
#[tokio::test(flavor = "current_thread")]
async fn a_long_poll_does_not_wake_for_what_it_cannot_receive() {
    with_delays_long_enough(async |unit| {
        let pool = pool().await;
        let (empty, recorder) = support::count_of("pgonce_queue_empty_receives_total");
        let _local = metrics::set_default_local_recorder(&recorder);
        let wait = unit * 3 / 2;

        let s = PgQueue::create(&pool, "s", QueueAttributes::default(), no_poll())
            .await
            .unwrap();
        let o = PgQueue::create(&pool, "o", QueueAttributes::default(), no_poll())
            .await
            .unwrap();
        o.send(SendMessage::new("elsewhere").delay(unit * 3 / 10))
            .await
            .unwrap();
        assert_eq!(
            empty_looks_in_a_long_poll(&s, &empty, wait).await?,
            2,
            "woken by another queue's delay"
        );

        let f = PgQueue::create(&pool, "f.fifo", QueueAttributes::fifo(), no_poll())
            .await
            .unwrap();
        // Sent through a handle that notifies no one: a send's notification
        // goes out after the send returns, from a task of its own, and one
        // that came during the long poll below would wake it, as it should.
        let quiet = PgQueueOptions {
            notify: false,
            ..no_poll()
        };
        let sender = PgQueue::open(&pool, "f.fifo", quiet).await.unwrap();
        for body in ["head", "b", "c"] {
            sender
                .send(SendMessage::new(body).group("g"))
                .await
                .unwrap();
        }
        let head = f
            .receive(ReceiveRequest::up_to(10).visibility(Duration::from_secs(3600)))
            .await
            .unwrap();
        assert_eq!(bodies(&head), ["head"]);
        assert_eq!(
            empty_looks_in_a_long_poll(&f, &empty, wait).await?,
            2,
            "woken for followers behind a head in flight"
        );
        Ok(())
    })
    .await;
}

/// A message sent with a delay while two receivers of a family are
/// parked reaches the one that stays, though the notification woke the
/// other, which then stopped before the delay ran out. Step by step on a
/// single-threaded runtime: R1 parks, then R2 (both for an hour, on a
/// [`no_poll`] handle); the delayed send's notification wakes the receiver
/// that waited longest, R1, seen to look once (an empty receive) and park
/// again; R1 is stopped. R2 must wake when the delay (a unit:
/// [`with_delays_long_enough`]) runs out. The notification used to end
/// with R1, and R2 slept to its poll interval.
#[tokio::test(flavor = "current_thread")]
async fn a_delayed_send_reaches_a_parked_receiver_when_the_woken_one_stops() {
    use std::sync::atomic::Ordering;
    with_delays_long_enough(async |unit| {
        let pool = pool().await;
        let (empty, recorder) = support::count_of("pgonce_queue_empty_receives_total");
        let _local = metrics::set_default_local_recorder(&recorder);
        let q = PgQueue::create(&pool, "s", QueueAttributes::default(), no_poll())
            .await
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let first = {
            let q = q.clone();
            tokio::spawn(async move {
                let request = ReceiveRequest::up_to(10).wait(LONG_POLL);
                q.receive_or_stop(request, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap()
            })
        };
        wait_until("a receive parked", || async { q.parked_receivers() > 0 }).await;
        let second = parked_receiver(&q).await;
        let looked = empty.load(Ordering::SeqCst);
        q.send(SendMessage::new("delayed").delay(unit))
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + FAILSAFE;
        while empty.load(Ordering::SeqCst) == looked || q.parked_receivers() < 2 {
            // R1 looked once the delay had run out, and took the message;
            // or, having looked before, it parked again so late that the
            // timer it set woke R2 first.
            if first.is_finished() || second.is_finished() {
                first.abort();
                second.abort();
                return Err(TooSlow(
                    "a receiver took the message before R1 parked again",
                ));
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "waited two minutes for R1 to look again and both to park, or one to end"
            );
            tokio::task::yield_now().await;
        }
        assert_eq!(
            empty.load(Ordering::SeqCst),
            looked + 1,
            "one receiver woken"
        );
        stop.send(()).unwrap();
        assert!(first.await.unwrap().is_empty(), "stopped, with nothing");
        let got = delivered(second, "a delay announced to a receiver that stopped").await;
        assert_eq!(bodies(&got), ["delayed"]);
        Ok(())
    })
    .await;
}

/// Why a run of a scenario with real delays proves nothing: a step it
/// needs before a delay runs out (a receiver looking, and parking, while a
/// message is still coming) came after it, on a machine too busy for the
/// delays it was given. Not a verdict: [`with_delays_long_enough`] runs the
/// scenario again with longer delays.
#[derive(Debug)]
struct TooSlow(&'static str);

/// Runs `scenario`, whose delays are multiples of the unit it is given (a
/// second at first), until a run's setup held: after a run it found
/// [`TooSlow`], again with a fresh database and the unit doubled. The
/// verdicts are asserted inside the scenario, on a run whose steps came in
/// the order it set up, whatever the machine's speed; a machine too slow
/// for a unit of 8 s fails the test. (Longer, the longest delays and
/// waits, six and four units, would run into [`delivered`]'s minute.)
async fn with_delays_long_enough(mut scenario: impl AsyncFnMut(Duration) -> Result<(), TooSlow>) {
    let mut unit = Duration::from_secs(1);
    loop {
        match scenario(unit).await {
            Ok(()) => return,
            Err(TooSlow(why)) if unit < Duration::from_secs(8) => {
                eprintln!("{why} with delays in units of {unit:?}: again, twice as long");
                unit *= 2;
            }
            Err(TooSlow(why)) => panic!("{why}, even with delays in units of {unit:?}"),
        }
    }
}

/// Every message is still delayed: the receivers a test parked did so
/// before any delay ran out ([`TooSlow`] otherwise).
async fn parked_before_the_delays_ran_out(pool: &PgPool) -> Result<(), TooSlow> {
    let still_delayed: bool =
        sqlx::query_scalar("SELECT bool_and(visible_at > now()) FROM pgonce.queue_message")
            .fetch_one(pool)
            .await
            .unwrap();
    if still_delayed {
        Ok(())
    } else {
        Err(TooSlow("the receivers parked only after a delay ran out"))
    }
}

/// [`parked_receiver_of`] for a test whose messages are all delayed: a
/// receiver that ended before it parked took a message whose delay had run
/// out ([`TooSlow`]).
async fn parked_before_any_delay_ran_out(
    q: &PgQueue,
    max: usize,
) -> Result<tokio::task::JoinHandle<Vec<pgonce::Received>>, TooSlow> {
    spawned_until_parked(q, max).await.map_err(|ended| {
        let got = ended.unwrap();
        assert!(!got.is_empty(), "a long poll of an hour returned nothing");
        TooSlow("a receiver took a message before it parked")
    })
}

/// A standard queue `s` and a [`no_poll`] handle on it on `on`, with
/// these messages sent, each with its delay in `unit`s, through a handle
/// on `pool` that notifies no one: only a look finds them, and the time
/// it finds wakes a long poll.
async fn sent_unannounced_with_delays(
    on: &PgPool,
    pool: &PgPool,
    sent: &[(&str, u32)],
    unit: Duration,
) -> PgQueue {
    let q = PgQueue::create(on, "s", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    let quiet = PgQueueOptions {
        notify: false,
        ..no_poll()
    };
    let sender = PgQueue::open(pool, "s", quiet).await.unwrap();
    // One batch, one statement: messages with the same delay become
    // visible at the same instant. Sent one by one, on a busy machine the
    // second could come due after a receiver woken for the first had
    // looked, found it still coming and parked again behind the others.
    let batch = sent
        .iter()
        .map(|&(body, units)| SendMessage::new(body).delay(unit * units))
        .collect();
    sender.send_batch(batch).await.unwrap();
    q
}

/// A message that several parked receivers of a family all saw coming
/// (sent with a delay before they looked) wakes one of them when it
/// becomes visible, not all four: as with a notification, one receiver
/// wakes per message. The one that takes it passes the wake on, since the
/// others have not seen what comes after it, so at most one looks in vain.
/// Each receiver used to sleep to the time its own look had found, and all
/// four looked at that instant: three found nothing.
///
/// Counted, not timed, on a single-threaded runtime (the thread-local
/// recorder sees every receive): the message is sent through a handle that
/// notifies no one; four receivers (an hour's poll) each look once and
/// park, before the delay runs out; each waits past it and looks once more
/// as its wait ends, unless it got the message. What is left of the empty
/// looks once all four have returned was made in between. The delay is
/// two units, the waits four ([`with_delays_long_enough`]).
#[tokio::test(flavor = "current_thread")]
async fn a_message_becoming_visible_wakes_one_parked_receiver_not_the_family() {
    use std::sync::atomic::Ordering;
    with_delays_long_enough(async |unit| {
        let pool = pool().await;
        let (empty, recorder) = support::count_of("pgonce_queue_empty_receives_total");
        let _local = metrics::set_default_local_recorder(&recorder);
        let q = sent_unannounced_with_delays(&pool, &pool, &[("delayed", 2)], unit).await;
        let receivers: Vec<_> = (0..4).map(|_| long_poll(&q, unit * 4)).collect();
        while q.parked_receivers() < 4 {
            // One that took the message before it parked never parks.
            if receivers.iter().any(|r| r.is_finished()) {
                receivers.iter().for_each(|r| r.abort());
                return Err(TooSlow("a receiver took the message before it parked"));
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(
            empty.load(Ordering::SeqCst),
            4,
            "each looked once, then parked"
        );
        if let Err(too_slow) = parked_before_the_delays_ran_out(&pool).await {
            receivers.iter().for_each(|r| r.abort());
            return Err(too_slow);
        }
        let mut got = Vec::new();
        for receiver in receivers {
            got.extend(delivered(receiver, "the end of its wait").await);
        }
        assert_eq!(bodies(&got), ["delayed"]);
        let looks = empty.load(Ordering::SeqCst);
        // Four as they began, three as the waits of those that got nothing ended.
        let in_vain = looks.saturating_sub(4 + 3);
        assert!(
            in_vain <= 1,
            "{in_vain} looked in vain when the message became visible ({looks} empty looks)"
        );
        Ok(())
    })
    .await;
}

/// Two messages sent with delays (the second a unit after the first, at
/// one unit: [`with_delays_long_enough`]) through a handle that notifies
/// no one, and two receivers of a family parked for an hour, each having
/// looked once: both saw only the first time. The family's timer wakes
/// one of them for the first message; it takes it and wakes the other,
/// which looks, finds the second coming and sets the timer for it: the
/// second message reaches the receiver left parked when it becomes
/// visible, not at its poll interval an hour away ([`delivered`] fails it
/// after a minute).
#[tokio::test]
async fn a_receiver_the_timer_woke_that_delivered_leaves_the_next_time_to_the_family() {
    with_delays_long_enough(async |unit| {
        let pool = pool().await;
        let q =
            sent_unannounced_with_delays(&pool, &pool, &[("first", 1), ("second", 2)], unit).await;
        let one = parked_before_any_delay_ran_out(&q, 10).await?;
        let parked = async {
            let other = parked_before_any_delay_ran_out(&q, 10).await?;
            parked_before_the_delays_ran_out(&pool).await?;
            Ok(other)
        };
        let other = parked.await.inspect_err(|_| one.abort())?;
        let (got, left) = match futures::future::select(one, other).await {
            futures::future::Either::Left((got, left)) => (got, left),
            futures::future::Either::Right((got, left)) => (got, left),
        };
        let got = got.unwrap();
        if got.len() == 2 {
            left.abort();
            return Err(TooSlow(
                "the receiver woken for the first message looked once the second was due",
            ));
        }
        assert_eq!(bodies(&got), ["first"]);
        assert_eq!(
            woken(left, "the second message becoming visible").await,
            ["second"]
        );
        Ok(())
    })
    .await;
}

/// A receiver the family's timer woke that fills its batch passes the
/// timer's wake on, not a notification's: the receiver it wakes may take
/// the rest and stop there, and then no look has seen what comes after.
/// a and b are sent with a delay of two units, c with four
/// ([`with_delays_long_enough`]: 2 s and 4 s at first), through a handle
/// that notifies no one; R1 (a batch of one), R2 and R3 (ten) park for an
/// hour, in that order, each having seen only a and b coming. The timer
/// wakes R1, the oldest waiter: it takes a, a full batch, and wakes R2,
/// which takes b. c must reach R3 when it becomes visible, not at its
/// poll interval an hour away ([`delivered`] fails it after a minute). R1
/// used to pass the wake on as a notification: R2, woken by one,
/// delivered part of a batch and passed nothing on, and no receiver set
/// the timer for c.
#[tokio::test(flavor = "current_thread")]
async fn a_receiver_the_timer_woke_that_filled_its_batch_leaves_the_next_time_to_the_family() {
    with_delays_long_enough(async |unit| {
        let pool = pool().await;
        let sent = [("a", 2), ("b", 2), ("c", 4)];
        let q = sent_unannounced_with_delays(&pool, &pool, &sent, unit).await;
        let mut parked = Vec::new();
        for max in [1, 10, 10] {
            match parked_before_any_delay_ran_out(&q, max).await {
                Ok(receiver) => parked.push(receiver),
                Err(too_slow) => {
                    parked.iter().for_each(|r| r.abort());
                    return Err(too_slow);
                }
            }
        }
        if let Err(too_slow) = parked_before_the_delays_ran_out(&pool).await {
            parked.iter().for_each(|r| r.abort());
            return Err(too_slow);
        }
        let [r1, r2, r3] = <[_; 3]>::try_from(parked).unwrap();
        assert_eq!(woken(r1, "a becoming visible").await, ["a"]);
        let r2_got = woken(r2, "the wake r1 passed on").await;
        if r2_got == ["b", "c"] {
            r3.abort();
            return Err(TooSlow("the receiver r1 woke looked once c was due"));
        }
        assert_eq!(r2_got, ["b"]);
        assert_eq!(woken(r3, "c becoming visible").await, ["c"]);
        Ok(())
    })
    .await;
}

/// A receiver woken by a notification whose wait ends before its look
/// does still hands the family's timer the time that look found. R1 (a
/// wait of two units: [`with_delays_long_enough`]) and R2 (an hour) of one
/// family park on a pool of one connection, which the test then holds; a
/// message sent with a delay of six units notifies, and wakes R1 alone. R1
/// waits for the connection until its wait is over, then looks, finds the
/// message coming and returns with nothing. R2, which looked before the
/// send, must be woken when the delay runs out, not at its poll interval
/// an hour away ([`delivered`] fails it after a minute). R1 used to return
/// before it set the timer: only a receiver that parked again told the
/// family what it had found.
#[tokio::test]
async fn a_receiver_whose_wait_ends_at_its_look_leaves_the_next_time_to_the_family() {
    with_delays_long_enough(async |unit| {
        let (db, pool) = fresh_migrated_database(20, pgonce::migrate).await;
        let small = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(db.options())
            .await
            .unwrap();
        let q = PgQueue::create(&small, "s", QueueAttributes::default(), no_poll())
            .await
            .unwrap();
        let wait = unit * 2;
        let r1 = long_poll(&q, wait);
        while q.parked_receivers() < 1 {
            // Its first look ended after its wait: it never parks.
            if r1.is_finished() {
                return Err(TooSlow("R1 looked first once its wait was over"));
            }
            tokio::task::yield_now().await;
        }
        // R1 began its wait before now: it ends before `wait` from now.
        let r1_wait_over = std::time::Instant::now() + wait;
        let r2 = parked_receiver(&q).await;
        let held = small.acquire().await.unwrap();
        let sender = PgQueue::open(&pool, "s", no_poll()).await.unwrap();
        sender
            .send(SendMessage::new("delayed").delay(unit * 6))
            .await
            .unwrap();
        // The notification woke one of them: R1, the oldest waiter.
        wait_until("all but one parked receive woken", || async {
            q.parked_receivers() <= 1
        })
        .await;
        tokio::time::sleep_until(r1_wait_over.into()).await;
        drop(held);
        if !delivered(r1, "the end of its wait").await.is_empty() {
            r2.abort();
            return Err(TooSlow("R1 looked only once the delay had run out"));
        }
        assert_eq!(
            woken(r2, "the delayed message becoming visible").await,
            ["delayed"]
        );
        Ok(())
    })
    .await;
}

/// Two receivers of a family parked for an hour for a message sent with a
/// delay (through a handle that notifies no one), which both saw coming:
/// the family's timer wakes the one that parked first, which is held
/// before it looks (its pool has no connection free) and then `lost`. The
/// other, parked for an hour, takes the message: the wake the first took
/// is passed on, not lost with it ([`delivered`] fails it after a minute).
/// Both park, and the test holds the connection, before the delay of two
/// units runs out ([`with_delays_long_enough`]).
async fn a_receiver_the_timer_woke_that_does_not_look_passes_the_wake_on(lost: Lost) {
    with_delays_long_enough(async |unit| {
        let (db, pool) = fresh_migrated_database(20, pgonce::migrate).await;
        let small = pool_of_one(&db).await;
        let q = sent_unannounced_with_delays(&small, &pool, &[("delayed", 2)], unit).await;
        let first = {
            let q = q.clone();
            tokio::spawn(async move {
                let request = ReceiveRequest::up_to(10).wait(LONG_POLL);
                q.receive(request).await.map(|r| r.len())
            })
        };
        let deadline = tokio::time::Instant::now() + FAILSAFE;
        while q.parked_receivers() < 1 {
            if first.is_finished() {
                assert_eq!(first.await.unwrap().unwrap(), 1, "it took the message");
                return Err(TooSlow(
                    "the first receiver took the message before it parked",
                ));
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "waited two minutes for the first receiver to park or end"
            );
            tokio::task::yield_now().await;
        }
        let setup = async {
            let second = parked_before_any_delay_ran_out(&q, 10).await?;
            let held = small.acquire().await.unwrap();
            if let Err(too_slow) = parked_before_the_delays_ran_out(&pool).await {
                second.abort();
                return Err(too_slow);
            }
            Ok((second, held))
        };
        let (second, held) = setup.await.inspect_err(|_| first.abort())?;
        // The timer woke one of them: the first, the oldest waiter.
        wait_until("all but one parked receive woken", || async {
            q.parked_receivers() <= 1
        })
        .await;
        lose(first, lost).await;
        drop(held);
        assert_eq!(
            woken(second, "the timer's wake passed on").await,
            ["delayed"]
        );
        Ok(())
    })
    .await;
}

#[tokio::test]
async fn a_receiver_the_timer_woke_dropped_before_it_looks_passes_the_wake_on() {
    a_receiver_the_timer_woke_that_does_not_look_passes_the_wake_on(Lost::Dropped).await;
}

#[tokio::test]
async fn a_receiver_the_timer_woke_whose_look_fails_passes_the_wake_on() {
    a_receiver_the_timer_woke_that_does_not_look_passes_the_wake_on(Lost::Failed).await;
}

/// A receive statement that fails after it locked a message (its pick
/// takes the earliest visible, FOR UPDATE SKIP LOCKED) turned the other
/// receivers away from it while it ran: a long poll that looked then
/// skipped it, found nothing, and saw no time to wake at (the message was
/// visible to its snapshot). Rolled back, the message is receivable again,
/// and the failing receive wakes the parked receivers as a send would.
/// It used to say nothing, and the message waited for their poll interval
/// (an hour here: [`woken`] fails it after a minute).
///
/// Step by step: a trigger on the messages' updates makes session R1's
/// receive (R1 alone, by a setting of its session) wait for an advisory
/// lock that session G holds, seen blocked in `pg_blocking_pids`, with the
/// message locked; a long poll of another handle family then looks and
/// parks; G lets go, the trigger fails R1's statement, which rolls back.
#[tokio::test]
async fn a_receive_failing_after_it_locked_a_message_wakes_the_receivers_it_turned_away() {
    let (db, pool) = fresh_migrated_database(20, pgonce::migrate).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let gate = race.session("G").await.unwrap();
    let r1 = race.session("R1").await.unwrap();
    r1.set("pgonce_test.fail_receive", "on").await.unwrap();
    sqlx::raw_sql(
        "CREATE FUNCTION public.fail_receive() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
             IF current_setting('pgonce_test.fail_receive', true) = 'on' THEN \
                 PERFORM pg_advisory_xact_lock(42); \
                 RAISE EXCEPTION 'this receive fails after its pick'; \
             END IF; \
             RETURN NEW; \
         END $$; \
         CREATE TRIGGER fail_receive BEFORE UPDATE ON pgonce.queue_message \
         FOR EACH ROW EXECUTE FUNCTION public.fail_receive();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let q = sent_unannounced_with_delays(&pool, &pool, &[("m", 0)], Duration::ZERO).await;
    race.try_step(
        &gate,
        "lock 42",
        sqlx::query("SELECT pg_advisory_lock(42)").execute(gate.pool()),
    )
    .await
    .unwrap();
    let other = PgQueue::open(r1.pool(), "s", PgQueueOptions::default())
        .await
        .unwrap();
    let failing = race
        .step_blocks(&r1, "receive, stalled after its pick", async move {
            other.receive(ReceiveRequest::up_to(1)).await
        })
        .await
        .unwrap();
    assert_eq!(failing.blocked_by(), ["G"]);
    let receiver = parked_receiver(&q).await;
    race.try_step(
        &gate,
        "unlock 42",
        sqlx::query("SELECT pg_advisory_unlock(42)").execute(gate.pool()),
    )
    .await
    .unwrap();
    let failed = failing.resume().await.unwrap();
    assert!(failed.is_err(), "the trigger failed it: {failed:?}");
    assert_eq!(
        woken(receiver, "the failed receive's rollback").await,
        ["m"]
    );
}

/// A receive whose follow-up statement fails after an earlier one moved
/// messages to the dead-letter queue wakes the receivers parked there:
/// each statement commits on its own, so the moves stand. It used to
/// return the error without the wake, and they waited for their poll
/// interval (an hour here: [`woken`] fails it after a minute).
///
/// Three messages past their receive count, in this order; a receive of
/// one looks at the first (its lean first statement decides no move),
/// then at two, which it moves, then further, at the third, whose move a
/// trigger fails.
#[tokio::test]
async fn a_receive_failing_after_it_moved_messages_wakes_the_dead_letter_queue() {
    let pool = pool().await;
    sqlx::raw_sql(
        "CREATE FUNCTION public.fail_move() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
             IF NEW.body = 'fails' AND NEW.queue IS DISTINCT FROM OLD.queue THEN \
                 RAISE EXCEPTION 'this move fails'; \
             END IF; \
             RETURN NEW; \
         END $$; \
         CREATE TRIGGER fail_move BEFORE UPDATE ON pgonce.queue_message \
         FOR EACH ROW EXECUTE FUNCTION public.fail_move();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let dlq = PgQueue::create(&pool, "s-dlq", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    let q = PgQueue::create(
        &pool,
        "s",
        QueueAttributes::default().dead_letter("s-dlq", 1),
        no_poll(),
    )
    .await
    .unwrap();
    for body in ["m1", "m2", "fails"] {
        q.send(SendMessage::new(body)).await.unwrap();
    }
    let first = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&first), ["m1", "m2", "fails"]);
    for received in &first {
        q.change_visibility(&received.receipt, Duration::ZERO)
            .await
            .unwrap();
    }
    let receiver = parked_receiver(&dlq).await;
    let failed = q.receive(ReceiveRequest::up_to(1)).await;
    assert!(failed.is_err(), "the trigger failed it: {failed:?}");
    assert_eq!(
        woken(receiver, "the moves before the failure").await,
        ["m1", "m2"]
    );
}

/// A FIFO group's head whose lease runs out during a long poll is
/// delivered again then, before the messages of its group behind it.
#[tokio::test]
async fn a_fifo_heads_lease_running_out_ends_a_long_poll() {
    let pool = pool().await;
    let f = PgQueue::create(&pool, "f.fifo", QueueAttributes::fifo(), no_poll())
        .await
        .unwrap();
    for body in ["a", "b"] {
        f.send(SendMessage::new(body).group("g")).await.unwrap();
    }
    let a = f
        .receive(ReceiveRequest::up_to(10).visibility(Duration::from_millis(300)))
        .await
        .unwrap();
    assert_eq!(bodies(&a), ["a"]);
    let got = delivered(long_poll(&f, LONG_POLL), "the head's lease running out").await;
    assert_eq!(bodies(&got), ["a"]);
}

/// A receive waiting for a pooled connection has not begun its delivery:
/// [`Received::requested_at`] is taken once it has the connection, so the
/// worker counts none of that wait into the lease. It used to be taken
/// before the pool was asked. Step by step on a pool of one: the test
/// holds the connection, the receive is started (on this single-threaded
/// runtime it runs to its wait for the pool as the test yields), the test
/// notes the time and gives the connection back.
#[tokio::test]
async fn a_delivery_is_counted_from_its_statement_not_from_a_wait_for_the_pool() {
    let (_db, pool) = fresh_migrated_database(1, pgonce::migrate).await;
    let options = PgQueueOptions {
        notify: false,
        ..no_poll()
    };
    let q = PgQueue::create(&pool, "q", QueueAttributes::default(), options)
        .await
        .unwrap();
    q.send(SendMessage::new("m")).await.unwrap();
    let held = pool.acquire().await.unwrap();
    let receiver = {
        let q = q.clone();
        tokio::spawn(async move { q.receive(ReceiveRequest::up_to(1)).await.unwrap() })
    };
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert!(
        !receiver.is_finished(),
        "the receive waits for the pool's one connection"
    );
    let released = std::time::Instant::now();
    drop(held);
    let got = receiver.await.unwrap();
    assert_eq!(bodies(&got), ["m"]);
    assert!(
        got[0].requested_at >= released,
        "requested {:?} before the pool had a connection for it: the wait for the pool is \
         counted as the delivery's",
        released - got[0].requested_at
    );
}

#[tokio::test]
async fn a_heartbeat_after_the_queue_visibility_ran_out_leaves_the_other_delivery_alone() {
    let pool = pool().await;
    conformance_heartbeat_after_the_queue_visibility_ran_out(
        &queue(&pool, "q", one_second()).await,
    )
    .await;
}

#[tokio::test]
async fn malformed_bodies_reach_the_error_path_then_the_dead_letter_queue() {
    let pool = pool().await;
    let (q, dlq) = with_dead_letters(&pool).await;
    conformance_malformed_bodies_reach_dead_letters(&q, &dlq).await;
}

#[tokio::test]
async fn the_heartbeat_keeps_a_running_message_invisible() {
    let pool = pool().await;
    conformance_heartbeat_keeps_message_invisible(&queue(&pool, "q", one_second()).await).await;
}

#[tokio::test]
async fn transactional_enqueue_sends_only_on_commit() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    q.send_in(&mut tx, SendMessage::new("rolled back"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        q.stats().await.unwrap().depth,
        0,
        "rolled back: nothing sent"
    );

    let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    q.send_batch_in(&mut tx, vec![SendMessage::new("a"), SendMessage::new("b")])
        .await
        .unwrap();
    assert_eq!(q.stats().await.unwrap().depth, 0, "invisible before commit");
    tx.commit().await.unwrap();
    assert_eq!(q.stats().await.unwrap().depth, 2);
}

#[tokio::test]
async fn concurrent_receivers_never_get_the_same_message() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let n = 200;
    let batch: Vec<_> = (0..n).map(|i| SendMessage::new(format!("{i}"))).collect();
    q.send_batch(batch).await.unwrap();
    let receivers = (0..8).map(|_| {
        let q = q.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            loop {
                let got = q.receive(ReceiveRequest::up_to(7)).await.unwrap();
                if got.is_empty() {
                    return ids;
                }
                ids.extend(got.into_iter().map(|m| m.id));
            }
        })
    });
    let mut all: Vec<String> = futures::future::join_all(receivers)
        .await
        .into_iter()
        .flat_map(|r| r.unwrap())
        .collect();
    let total = all.len();
    all.sort();
    all.dedup();
    assert_eq!(
        (total, all.len()),
        (n, n),
        "each message delivered exactly once"
    );
}

#[tokio::test]
async fn bad_input_is_a_typed_error_and_writes_nothing() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let big = SendMessage::new("x".repeat(pgonce::queue::MAX_BODY_BYTES + 1));
    assert!(matches!(
        q.send(big).await,
        Err(Error::MessageTooLarge { .. })
    ));
    let batch = vec![SendMessage::new("fine"), SendMessage::new("a\0b")];
    assert!(matches!(
        q.send_batch(batch).await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        q.send(SendMessage::new("x").group("g")).await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        q.delete(&Receipt("not-a-receipt".into())).await,
        Err(Error::StaleReceipt { .. })
    ));
    assert!(matches!(
        q.receive(ReceiveRequest::up_to(0)).await,
        Err(Error::Invalid { .. })
    ));
    assert_eq!(q.stats().await.unwrap().depth, 0, "nothing half-written");
    assert!(matches!(
        PgQueue::open(&pool, "missing", PgQueueOptions::default()).await,
        Err(Error::QueueNotFound { .. })
    ));
    assert!(matches!(
        PgQueue::create(
            &pool,
            "x",
            QueueAttributes::default().dead_letter("missing", 3),
            PgQueueOptions::default()
        )
        .await,
        Err(Error::QueueNotFound { .. })
    ));
    assert!(matches!(
        PgQueue::create(
            &pool,
            "q",
            QueueAttributes::fifo(),
            PgQueueOptions::default()
        )
        .await,
        Err(Error::Invalid { .. })
    ));
}

/// Values at the edge of their types: ids with a NUL (which PostgreSQL's
/// text cannot hold), a retention or deduplication window PostgreSQL cannot
/// subtract from now() (every receive or deduplicated send would fail), a
/// max_receive_count beyond the column's integer. Each is a typed error,
/// and nothing is written.
#[tokio::test]
async fn values_at_the_edge_of_their_types_are_typed_errors_and_write_nothing() {
    let pool = pool().await;
    let fifo = queue(&pool, "f.fifo", QueueAttributes::fifo()).await;
    for message in [
        SendMessage::new("x").group("g").dedup("a\0b"),
        SendMessage::new("x").group("g\0h"),
    ] {
        let refused = fifo.send(message.clone()).await;
        assert!(
            matches!(refused, Err(Error::Invalid { .. })),
            "{message:?}: {refused:?}"
        );
    }
    assert_eq!(fifo.stats().await.unwrap().depth, 0);
    let ages = 100_000 * 365 * 24 * 3600;
    let long_retention = QueueAttributes {
        retention: Duration::from_secs(ages),
        ..QueueAttributes::default()
    };
    let long_window = QueueAttributes::default().dedup_window(Duration::from_secs(ages));
    queue(&pool, "dlq", QueueAttributes::default()).await;
    let mut many_receives = QueueAttributes::default().dead_letter("dlq", 1);
    many_receives.max_receive_count = Some(u32::MAX);
    for attributes in [long_retention, long_window, many_receives] {
        let refused = PgQueue::create(&pool, "edge", attributes.clone(), fast_poll()).await;
        assert!(
            matches!(refused, Err(Error::Invalid { .. })),
            "{attributes:?}: {refused:?}"
        );
    }
    let created: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.queue WHERE name = 'edge'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(created, 0);
}

/// A receive count at the top of its type (a message bouncing through a
/// cycle of dead-letter queues is received without end) stays there: the
/// receive delivers it and the queue's other groups, where adding one
/// failed the whole receive with an integer overflow.
#[tokio::test]
async fn a_receive_count_at_the_top_of_its_type_saturates() {
    let pool = pool().await;
    let q = queue(&pool, "f.fifo", QueueAttributes::fifo()).await;
    q.send(SendMessage::new("worn").group("g")).await.unwrap();
    q.send(SendMessage::new("new").group("h")).await.unwrap();
    sqlx::query("UPDATE pgonce.queue_message SET receive_count = 2147483647 WHERE body = 'worn'")
        .execute(&pool)
        .await
        .unwrap();
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&got), ["worn", "new"]);
    assert_eq!(got[0].receive_count, 2147483647);
}

/// At the top of its receive count, a message still moves to the
/// dead-letter queue after `max_receive_count` receives in its queue, in a
/// cycle of dead-letter queues (s to d and back) as far as it goes: every
/// receive still counts toward the move. The count saturated and the rule,
/// which counts the receives since the message came into its queue from
/// it, stopped counting: a message at the top was delivered from its
/// queue forever and never moved again.
#[tokio::test]
async fn a_message_at_the_top_of_its_receive_count_still_moves_to_the_dead_letter_queue() {
    let pool = pool().await;
    queue(&pool, "s", QueueAttributes::default()).await;
    queue(&pool, "d", QueueAttributes::default().dead_letter("s", 2)).await;
    let s = queue(&pool, "s", QueueAttributes::default().dead_letter("d", 2)).await;
    let d = PgQueue::open(&pool, "d", PgQueueOptions::default())
        .await
        .unwrap();
    s.send(SendMessage::new("worn")).await.unwrap();
    // Received in s once since it came there, at the top of its count.
    sqlx::query(
        "UPDATE pgonce.queue_message \
         SET receive_count = 2147483647, receive_base = 2147483646",
    )
    .execute(&pool)
    .await
    .unwrap();
    let again = ReceiveRequest::up_to(1).visibility(Duration::ZERO);
    let mut path = Vec::new();
    for (q, to) in [(&s, "d"), (&d, "s"), (&s, "d")] {
        // Each queue's receives until the message is gone from it: one to
        // go in s the first time, two in d and in s after that.
        let mut delivered = 0;
        while !q.receive(again).await.unwrap().is_empty() {
            delivered += 1;
            assert!(delivered <= 2, "delivered from {} a third time", q.name());
        }
        assert_eq!(queues_of_messages(&pool).await, [to]);
        path.push((q.name().to_string(), delivered));
    }
    assert_eq!(path, [("s".into(), 1), ("d".into(), 2), ("s".into(), 2)]);
}

/// Queue `q` with `attributes`, and a step-by-step harness with one session
/// per name, each with its own handle on `q`.
async fn raced(
    attributes: QueueAttributes,
    names: &[&str],
) -> (
    pgonce_testkit::ScratchDatabase,
    pgonce_testkit::Interleaving,
    Vec<(pgonce_testkit::Session, PgQueue)>,
) {
    let db = fresh_database().await;
    let setup = db.pool(2).await.unwrap();
    pgonce::migrate(&setup).await.unwrap();
    PgQueue::create(&setup, "q", attributes, fast_poll())
        .await
        .unwrap();
    let race = pgonce_testkit::Interleaving::new(db.options())
        .await
        .unwrap();
    let mut sessions = Vec::new();
    for name in names {
        let session = race.session(name).await.unwrap();
        let queue = PgQueue::open(session.pool(), "q", fast_poll())
            .await
            .unwrap();
        sessions.push((session, queue));
    }
    (db, race, sessions)
}

/// The dedup race, step by step: B sends with the dedup id A has claimed in
/// its open transaction; B blocks on A's claim (seen in pg_blocking_pids).
/// If A commits, B returns A's id as a duplicate (its first snapshot could
/// not see A's row: the retry reads it). If A rolls back, B enqueues anew.
#[tokio::test]
async fn a_send_racing_an_uncommitted_dedup_claim_waits_and_then_agrees() {
    let (_db, race, mut sessions) = raced(QueueAttributes::default(), &["A", "B"]).await;
    let (b, qb) = sessions.pop().unwrap();
    let (a, qa) = sessions.pop().unwrap();

    for commit in [true, false] {
        let key = format!("k-{commit}");
        let mut tx = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        let sent_a = race
            .step(
                &a,
                "send k in tx",
                qa.send_in(&mut tx, SendMessage::new("a").dedup(&key)),
            )
            .await
            .unwrap()
            .unwrap();
        let (qb2, key2) = (qb.clone(), key.clone());
        let waiting = race
            .step_blocks(&b, "send k", async move {
                qb2.send(SendMessage::new("b").dedup(key2)).await
            })
            .await
            .unwrap();
        assert_eq!(waiting.blocked_by(), ["A"]);
        if commit {
            race.step(&a, "commit", tx.commit()).await.unwrap().unwrap();
        } else {
            race.step(&a, "rollback", tx.rollback())
                .await
                .unwrap()
                .unwrap();
        }
        let sent_b = waiting.resume().await.unwrap().unwrap();
        if commit {
            assert!(sent_b.duplicate, "A's committed claim wins");
            assert_eq!(sent_b.id, sent_a.id);
        } else {
            assert!(!sent_b.duplicate, "A rolled back: B's message is the one");
            assert_ne!(sent_b.id, sent_a.id);
        }
    }
    let got = qa.receive(ReceiveRequest::up_to(10)).await.unwrap();
    let bodies = bodies(&got);
    assert_eq!(
        bodies,
        ["a", "b"],
        "one message per dedup id, each from its winner"
    );
}

/// FIFO order when sends commit out of id order, step by step: A sends
/// "a" to group g in an open transaction (its id drawn first); B's send of
/// "b" to g waits for A (seen in pg_blocking_pids), while a send to another
/// group does not. Without that wait "b" committed first, a receive took it
/// as g's head, and once A committed "a" went to a second consumer while
/// "b" was still in flight.
#[tokio::test]
async fn a_fifo_group_keeps_commit_order_and_one_in_flight_when_a_send_commits_late() {
    let (_db, race, mut sessions) = raced(QueueAttributes::fifo(), &["A", "B", "C"]).await;
    let (c, qc) = sessions.pop().unwrap();
    let (b, qb) = sessions.pop().unwrap();
    let (a, qa) = sessions.pop().unwrap();

    let mut tx = a.pool().begin().await.unwrap();
    race.step(
        &a,
        "send a to g in tx",
        qa.send_in(&mut tx, SendMessage::new("a").group("g")),
    )
    .await
    .unwrap()
    .unwrap();
    race.step(&c, "send x to h", qc.send(SendMessage::new("x").group("h")))
        .await
        .unwrap()
        .unwrap();
    let qb2 = qb.clone();
    let waiting = race
        .step_blocks(&b, "send b to g", async move {
            qb2.send(SendMessage::new("b").group("g")).await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    race.step(&a, "commit", tx.commit()).await.unwrap().unwrap();
    waiting.resume().await.unwrap().unwrap();

    // Two consumers: each group's head once, "a" before "b".
    let first = qc.receive(ReceiveRequest::up_to(10)).await.unwrap();
    let mut heads = bodies(&first);
    heads.sort();
    assert_eq!(heads, ["a", "x"]);
    assert!(
        qb.receive(ReceiveRequest::up_to(10))
            .await
            .unwrap()
            .is_empty(),
        "b waits for a"
    );
    let a_msg = first.iter().find(|m| m.body == "a").unwrap();
    qc.delete(&a_msg.receipt).await.unwrap();
    let next = qb.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&next), ["b"]);
}

/// Waits for all of its kind to be running at once.
struct AllAtOnce(std::sync::Arc<tokio::sync::Barrier>);

impl pgonce::Handler for AllAtOnce {
    async fn handle(&self, _m: &pgonce::Received) -> Result<(), pgonce::HandlerError> {
        self.0.wait().await;
        Ok(())
    }
}

/// Handlers run with no database connection held: eight handlers that can
/// only finish together all run at once on a pool of two connections.
#[tokio::test]
async fn handlers_hold_no_database_connection() {
    let (_db, pool) = fresh_migrated_database(2, pgonce::migrate).await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let batch: Vec<_> = (0..8).map(|i| SendMessage::new(format!("{i}"))).collect();
    q.send_batch(batch).await.unwrap();
    let config = pgonce::WorkerConfig {
        concurrency: 8,
        batch: 8,
        ..pgonce::WorkerConfig::default()
    };
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(8));
    let worker = pgonce::Worker::new(q.clone(), AllAtOnce(barrier), config).unwrap();
    let done = tokio::time::timeout(Duration::from_secs(20), worker.run_once())
        .await
        .expect("all eight handlers ran at once on two connections")
        .unwrap();
    assert_eq!((done.succeeded, done.deleted), (8, 8));
}

/// Receipts: each names one delivery of one message in one queue. Every
/// case below presents a receipt that once named a real delivery, or never
/// did, and checks it is refused as stale with the message untouched.
mod receipts {
    use super::*;

    fn is_stale<T: std::fmt::Debug>(r: pgonce::Result<T>) -> bool {
        matches!(r, Err(Error::StaleReceipt { .. }))
    }

    /// Receives the one message of `q`, failing if there is none.
    async fn receive_one(q: &PgQueue) -> pgonce::Received {
        let mut got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
        assert_eq!(got.len(), 1, "one message receivable in {}", q.name());
        got.remove(0)
    }

    /// Receives and releases the message of `q` twice (the dead-letter
    /// budget of `with_dead_letters`); returns the second delivery.
    async fn exhaust(q: &PgQueue) -> pgonce::Received {
        let mut last = None;
        for _ in 0..2 {
            let m = receive_one(q).await;
            q.change_visibility(&m.receipt, Duration::ZERO)
                .await
                .unwrap();
            last = Some(m);
        }
        last.unwrap()
    }

    /// Moves the message of `q` to the dead-letter queue: exhausts its
    /// budget, then the next receive moves it. Returns the last delivery.
    async fn dead_letter(q: &PgQueue) -> pgonce::Received {
        let last = exhaust(q).await;
        assert!(
            q.receive(ReceiveRequest::up_to(10))
                .await
                .unwrap()
                .is_empty()
        );
        last
    }

    /// A source queue and its dead-letter queue, with one message moved
    /// there; the message's last delivery in the source queue.
    async fn poisoned() -> (PgQueue, PgQueue, pgonce::Received) {
        let (q, dlq) = with_dead_letters(&pool().await).await;
        q.send(SendMessage::new("poison")).await.unwrap();
        let last = dead_letter(&q).await;
        (q, dlq, last)
    }

    /// `receipt` presented to `q` hides nothing (12 h), deletes nothing,
    /// and a batch of it reports it stale.
    async fn refused(q: &PgQueue, receipt: &Receipt, when: &str) {
        let long = Duration::from_secs(12 * 3600);
        let name = q.name();
        assert!(
            is_stale(q.change_visibility(receipt, long).await),
            "hide in {name} {when}"
        );
        assert!(is_stale(q.delete(receipt).await), "delete in {name} {when}");
        let one = std::slice::from_ref(receipt);
        assert_eq!(
            q.delete_batch(one).await.unwrap(),
            one,
            "delete_batch in {name} {when}"
        );
    }

    /// The last delivery in the source queue, moved to the dead-letter
    /// queue: its receipt neither deletes nor hides it there (nor in the
    /// source queue, where it no longer is).
    #[tokio::test]
    async fn a_receipt_from_before_a_dead_letter_move_is_refused_in_the_dead_letter_queue() {
        let (q, dlq, last) = poisoned().await;
        refused(&dlq, &last.receipt, "after the move").await;
        refused(&q, &last.receipt, "after the move").await;
        let dead = receive_one(&dlq).await;
        assert_eq!(dead.id, last.id, "still there, and visible");
    }

    /// The last delivery in the source queue, dead-lettered then redriven
    /// back: its receipt neither deletes nor hides the redriven message.
    #[tokio::test]
    async fn a_receipt_from_before_a_redrive_is_refused_in_the_source_queue() {
        let (q, dlq, last) = poisoned().await;
        assert_eq!(dlq.redrive().await.unwrap(), 1);
        refused(&q, &last.receipt, "after the redrive").await;
        let back = receive_one(&q).await;
        assert_eq!(back.id, last.id, "still there, and visible");
        q.delete(&back.receipt).await.unwrap();
    }

    /// A delivery from the dead-letter queue, released and redriven: its
    /// receipt does not act on the message back in the source queue.
    #[tokio::test]
    async fn a_dead_letter_delivery_receipt_is_refused_after_the_redrive() {
        let (q, dlq, _) = poisoned().await;
        let dead = receive_one(&dlq).await;
        dlq.change_visibility(&dead.receipt, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(dlq.redrive().await.unwrap(), 1);
        refused(&q, &dead.receipt, "after the redrive").await;
        refused(&dlq, &dead.receipt, "after the redrive").await;
        let back = receive_one(&q).await;
        assert_eq!(back.id, dead.id, "still there, and visible");
    }

    /// One batch holding an earlier and the current delivery of one message:
    /// the current one deletes it, the earlier one is reported stale.
    #[tokio::test]
    async fn delete_batch_checks_each_delivery_not_each_message() {
        let pool = pool().await;
        let q = queue(&pool, "q", QueueAttributes::default()).await;
        q.send(SendMessage::new("m")).await.unwrap();
        let first = receive_one(&q).await;
        q.change_visibility(&first.receipt, Duration::ZERO)
            .await
            .unwrap();
        let second = receive_one(&q).await;
        let stale = q
            .delete_batch(&[first.receipt.clone(), second.receipt.clone()])
            .await
            .unwrap();
        assert_eq!(stale, std::slice::from_ref(&first.receipt));
        assert_eq!(q.stats().await.unwrap().in_flight, 0, "deleted");
    }

    /// A receipt of one queue presented to another, and receipts that were
    /// never issued: the same refusal as a stale one, nothing touched; a
    /// batch reports them stale and still deletes the good ones.
    #[tokio::test]
    async fn foreign_and_malformed_receipts_are_refused_as_stale() {
        let pool = pool().await;
        let a = queue(&pool, "a", QueueAttributes::default()).await;
        let b = queue(&pool, "b", QueueAttributes::default()).await;
        a.send(SendMessage::new("in a")).await.unwrap();
        let m = receive_one(&a).await;
        let mut refused = vec![m.receipt.clone()];
        for text in [
            "",
            "not-a-receipt",
            "a",
            "a:",
            "a:x:1",
            "a:1:x",
            "a:1:2:3",
            "1.1",
            "a:99999:1",
        ] {
            refused.push(Receipt(text.into()));
        }
        for r in &refused {
            assert!(is_stale(b.delete(r).await), "delete {r:?} in b");
            assert!(
                is_stale(b.change_visibility(r, Duration::ZERO).await),
                "change_visibility {r:?} in b"
            );
        }
        for r in &refused[1..] {
            assert!(is_stale(a.delete(r).await), "delete {r:?} in a");
            assert!(
                is_stale(a.change_visibility(r, Duration::ZERO).await),
                "change_visibility {r:?} in a"
            );
        }
        assert_eq!(b.delete_batch(&refused).await.unwrap(), refused);
        let mut batch = refused[1..].to_vec();
        batch.push(m.receipt.clone());
        assert_eq!(a.delete_batch(&batch).await.unwrap(), refused[1..]);
        assert_eq!(
            a.stats().await.unwrap().in_flight,
            0,
            "the good one deleted"
        );
    }

    /// Purge deletes the message; its receipt deletes nothing after, not
    /// even a message sent since.
    #[tokio::test]
    async fn a_receipt_from_before_a_purge_is_refused() {
        let pool = pool().await;
        let q = queue(&pool, "q", QueueAttributes::default()).await;
        q.send(SendMessage::new("m")).await.unwrap();
        let m = receive_one(&q).await;
        assert_eq!(q.purge().await.unwrap(), 1);
        q.send(SendMessage::new("next")).await.unwrap();
        assert!(is_stale(q.delete(&m.receipt).await));
        assert!(is_stale(
            q.change_visibility(&m.receipt, Duration::ZERO).await
        ));
        assert_eq!(receive_one(&q).await.body, "next");
    }
}

/// Random sequences of send, receive (of the largest batch the model can
/// fill, or of one to three messages), expiry, delete, change_visibility,
/// delete_batch, dead-letter moves, retention running out, redrive and
/// purge over two source queues sharing one dead-letter queue, against an
/// in-memory model of the contract: same deliveries, same refusals, same
/// rows after every step. Receipts of every delivery are kept, and
/// presented late, to the wrong queue, and mixed in batches; a few
/// never-issued receipts too.
///
/// A receive of a small batch ahead of messages past their retention or
/// due for the dead-letter queue is the path where a receive's first
/// statement only delivers and its follow-ups decide the rest: the model
/// says which messages each receive must deliver, which it must delete or
/// move on its way to them, and leaves open only what the contract leaves
/// open (a message past its retention or due to move, behind the last one
/// delivered, may be dealt with now or at a later receive).
///
/// `MODEL_TEST_CASES` sets the number of cases (default 64; see docs/testing.md).
mod model {
    use std::collections::BTreeMap;

    use super::*;
    use crate::support::queue_model::{
        delivered_as_modelled, outcome, read_rows, rows_match, step_and_compare, time_passes,
    };
    use proptest::prelude::*;

    /// Queues 0 and 1 are sources, dead-lettering to queue 2 after this
    /// many receives (each), until a [`Op::SetMaxReceives`] changes it.
    const MAX_RECEIVES: [u32; 2] = [1, 2];
    const DLQ: usize = 2;
    const LONG: Duration = Duration::from_secs(3600);

    /// Where a receipt is presented: the queue that issued it, or another.
    #[derive(Debug, Clone, Copy)]
    enum Target {
        Issuer,
        Queue(usize),
    }

    #[derive(Debug, Clone)]
    enum Op {
        Send(usize),
        /// A send with a delivery delay (ten minutes): not visible until
        /// time passes for it.
        SendDelayed(usize),
        /// A receive of up to this many messages from the queue.
        Receive(usize, usize),
        /// The message's visibility timeout runs out (counted from the
        /// newest message).
        Expire(usize),
        /// The message's retention runs out (counted from the oldest
        /// message when true, so that it comes early in a receive's
        /// picking order; otherwise from the newest): its send time moves
        /// past every queue's retention.
        Age(usize, bool),
        /// Every visibility timeout runs out.
        TimePasses,
        /// Receipts are counted from the newest issued.
        Delete(usize, Target),
        ChangeVisibility(usize, Target, bool),
        DeleteBatch(Vec<usize>, Target),
        Redrive,
        Purge(usize),
        /// The source queue's redrive policy is set again (`create` of the
        /// existing queue): dead-lettering after this many receives, or
        /// never (0).
        SetMaxReceives(usize, u32),
    }

    fn receipt_index() -> impl Strategy<Value = usize> {
        prop_oneof![3 => 0..3usize, 1 => 0..64usize]
    }

    fn target() -> impl Strategy<Value = Target> {
        prop_oneof![3 => Just(Target::Issuer), 1 => (0..3usize).prop_map(Target::Queue)]
    }

    /// Weighted so that the long paths (receive, release, receive again,
    /// dead-letter, redrive, present an old receipt) come up often, and a
    /// purge rarely empties a queue.
    fn op() -> impl Strategy<Value = Op> {
        let source_mostly = || prop_oneof![3 => 0..2usize, 1 => Just(DLQ)];
        prop_oneof![
            6 => source_mostly().prop_map(Op::Send),
            2 => source_mostly().prop_map(Op::SendDelayed),
            8 => (0..3usize, prop_oneof![1 => Just(100usize), 2 => 1..4usize])
                .prop_map(|(q, n)| Op::Receive(q, n)),
            3 => (0..4usize).prop_map(Op::Expire),
            3 => (0..6usize, any::<bool>()).prop_map(|(k, oldest)| Op::Age(k, oldest)),
            2 => Just(Op::TimePasses),
            4 => (receipt_index(), target()).prop_map(|(r, t)| Op::Delete(r, t)),
            6 => (receipt_index(), target(), any::<bool>())
                .prop_map(|(r, t, zero)| Op::ChangeVisibility(r, t, zero)),
            2 => (proptest::collection::vec(receipt_index(), 1..4), target())
                .prop_map(|(rs, t)| Op::DeleteBatch(rs, t)),
            4 => Just(Op::Redrive),
            1 => source_mostly().prop_map(Op::Purge),
            2 => (0..2usize, 0..4u32).prop_map(|(q, n)| Op::SetMaxReceives(q, n)),
        ]
    }

    /// A message as the contract says it is.
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Message {
        queue: usize,
        visible: bool,
        receive_count: u32,
        /// receive_count when it came into its queue (a move or a redrive).
        base: u32,
        /// The source queue of a dead-lettered message.
        from: Option<usize>,
        /// The delivery a receipt must name to act on it; none after a
        /// move.
        delivery: Option<u64>,
        /// Past its retention: the next receive that picks it deletes it.
        /// Its send time goes with it to the dead-letter queue and back.
        aged: bool,
    }

    /// A receipt handed out, or made up (no queue, no delivery).
    #[derive(Debug, Clone)]
    struct Issued {
        receipt: Receipt,
        queue: Option<usize>,
        id: String,
        delivery: u64,
    }

    #[derive(Debug)]
    struct Model {
        messages: BTreeMap<String, Message>,
        ids: Vec<String>,
        receipts: Vec<Issued>,
        deliveries: u64,
        /// Each source queue's max_receive_count as last set; none: it
        /// dead-letters nothing.
        max_receives: [Option<u32>; 2],
    }

    impl Default for Model {
        fn default() -> Self {
            Model {
                messages: BTreeMap::new(),
                ids: Vec::new(),
                receipts: Vec::new(),
                deliveries: 0,
                max_receives: MAX_RECEIVES.map(Some),
            }
        }
    }

    /// How often the paths under test came up, to show the run reached them.
    #[derive(Debug, Default, Clone, Copy)]
    struct Tally {
        /// Receives of one to three messages.
        small_receives: u64,
        /// Messages past their retention deleted by a receive.
        expired: u64,
        dead_lettered: u64,
        redriven: u64,
        purged: u64,
        /// Redrive policies set again.
        policies_set: u64,
        /// Messages sent with a delay.
        delayed: u64,
        accepted: u64,
        refused: u64,
    }

    impl Tally {
        fn judged(&mut self, valid: bool) {
            if valid {
                self.accepted += 1;
            } else {
                self.refused += 1;
            }
        }
    }

    impl Model {
        fn receipt(&self, from_newest: usize) -> Issued {
            let n = self.receipts.len();
            self.receipts[n - 1 - from_newest % n].clone()
        }

        fn presented_to(&self, issued: &Issued, target: Target) -> usize {
            match target {
                Target::Issuer => issued.queue.unwrap_or(0),
                Target::Queue(q) => q,
            }
        }

        /// True when `issued` names the current delivery of its message,
        /// in the queue it is presented to.
        fn valid(&self, issued: &Issued, queue: usize) -> bool {
            issued.queue == Some(queue)
                && self
                    .messages
                    .get(&issued.id)
                    .is_some_and(|m| m.queue == queue && m.delivery == Some(issued.delivery))
        }
    }

    async fn step(
        pool: &PgPool,
        queues: &[PgQueue; 3],
        model: &mut Model,
        op: &Op,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let needs_receipt = matches!(
            op,
            Op::Delete(..) | Op::ChangeVisibility(..) | Op::DeleteBatch(..)
        );
        if needs_receipt && model.receipts.is_empty() {
            return Ok(());
        }
        match op {
            Op::Send(q) | Op::SendDelayed(q) => {
                let delayed = matches!(op, Op::SendDelayed(_));
                let message = SendMessage::new("m");
                let message = if delayed {
                    message.delay(Duration::from_secs(600))
                } else {
                    message
                };
                let sent = queues[*q]
                    .send(message)
                    .await
                    .map_err(|e| format!("send: {e}"))?;
                if delayed {
                    tally.delayed += 1;
                }
                model.ids.push(sent.id.clone());
                model.messages.insert(
                    sent.id,
                    Message {
                        queue: *q,
                        visible: !delayed,
                        receive_count: 0,
                        base: 0,
                        from: None,
                        delivery: None,
                        aged: false,
                    },
                );
            }
            Op::Receive(q, n) => {
                let names: Vec<String> = queues.iter().map(|q| q.name().to_string()).collect();
                // The order a standard receive picks in (earliest visible
                // first) is the database's, read before the receive; the
                // model decides what happens to each message in it.
                let picking: Vec<i64> = sqlx::query_scalar(
                    "SELECT id FROM pgonce.queue_message \
                     WHERE queue = $1 AND visible_at <= now() ORDER BY visible_at, id",
                )
                .bind(&names[*q])
                .fetch_all(pool)
                .await
                .map_err(|e| format!("picking order: {e}"))?;
                let got = queues[*q]
                    .receive(ReceiveRequest::up_to(*n))
                    .await
                    .map_err(|e| format!("receive: {e}"))?;
                if *n < 100 {
                    tally.small_receives += 1;
                }
                // Where each message is now, for what the contract leaves
                // open: behind the batch's last delivery.
                let after: BTreeMap<String, String> = read_rows(pool, &names)
                    .await?
                    .into_iter()
                    .map(|r| (r.id.to_string(), r.queue))
                    .collect();
                let mut expected = BTreeMap::new();
                for id in picking.iter().map(i64::to_string) {
                    let max_receives = model.max_receives;
                    let Some(m) = model.messages.get_mut(&id) else {
                        return Err(format!("{id} visible in {q}, model has no such message"));
                    };
                    let due = *q != DLQ
                        && max_receives[*q].is_some_and(|max| m.receive_count - m.base >= max);
                    let full = expected.len() == *n;
                    let expire = m.aged && (!full || !after.contains_key(&id));
                    let dead_letter =
                        !m.aged && due && (!full || after.get(&id) == Some(&names[DLQ]));
                    if expire {
                        model.messages.remove(&id);
                        tally.expired += 1;
                    } else if dead_letter {
                        m.queue = DLQ;
                        m.base = m.receive_count;
                        m.from = Some(*q);
                        tally.dead_lettered += 1;
                        m.delivery = None;
                    } else if !full && !m.aged && !due {
                        model.deliveries += 1;
                        m.receive_count += 1;
                        m.visible = false;
                        m.delivery = Some(model.deliveries);
                        expected.insert(id.clone(), (m.receive_count, model.deliveries));
                    }
                }
                delivered_as_modelled(&got, &expected)?;
                for r in got {
                    model.receipts.push(Issued {
                        receipt: r.receipt,
                        queue: Some(*q),
                        delivery: expected[&r.id].1,
                        id: r.id,
                    });
                }
            }
            Op::Expire(k) => {
                if model.ids.is_empty() {
                    return Ok(());
                }
                let id = &model.ids[model.ids.len() - 1 - k % model.ids.len()];
                sqlx::query(
                    "UPDATE pgonce.queue_message \
                     SET visible_at = least(visible_at, now() - interval '1 ms') WHERE id = $1",
                )
                .bind(id.parse::<i64>().unwrap())
                .execute(pool)
                .await
                .map_err(|e| format!("expire: {e}"))?;
                if let Some(m) = model.messages.get_mut(id) {
                    m.visible = true;
                }
            }
            Op::Age(k, oldest) => {
                if model.ids.is_empty() {
                    return Ok(());
                }
                let k = k % model.ids.len();
                let id = &model.ids[if *oldest { k } else { model.ids.len() - 1 - k }];
                sqlx::query(
                    "UPDATE pgonce.queue_message \
                     SET sent_at = now() - interval '15 days' WHERE id = $1",
                )
                .bind(id.parse::<i64>().unwrap())
                .execute(pool)
                .await
                .map_err(|e| format!("age: {e}"))?;
                if let Some(m) = model.messages.get_mut(id) {
                    m.aged = true;
                }
            }
            Op::TimePasses => {
                time_passes(pool, queues).await?;
                model.messages.values_mut().for_each(|m| m.visible = true);
            }
            Op::Delete(r, t) => {
                let issued = model.receipt(*r);
                let q = model.presented_to(&issued, *t);
                let valid = model.valid(&issued, q);
                let got = queues[q].delete(&issued.receipt).await;
                tally.judged(valid);
                let want = if valid { "ok" } else { "stale" };
                if outcome(&got) != want {
                    return Err(format!("delete {issued:?} in {q}: {got:?}, model {want}"));
                }
                if valid {
                    model.messages.remove(&issued.id);
                }
            }
            Op::ChangeVisibility(r, t, zero) => {
                let issued = model.receipt(*r);
                let q = model.presented_to(&issued, *t);
                let valid = model.valid(&issued, q);
                let timeout = if *zero { Duration::ZERO } else { LONG };
                let got = queues[q].change_visibility(&issued.receipt, timeout).await;
                tally.judged(valid);
                let want = if valid { "ok" } else { "stale" };
                if outcome(&got) != want {
                    return Err(format!(
                        "change_visibility {issued:?} in {q}: {got:?}, model {want}"
                    ));
                }
                if valid {
                    model.messages.get_mut(&issued.id).unwrap().visible = *zero;
                }
            }
            Op::DeleteBatch(rs, t) => {
                let batch: Vec<Issued> = rs.iter().map(|r| model.receipt(*r)).collect();
                let q = model.presented_to(&batch[0], *t);
                let valid: Vec<bool> = batch.iter().map(|i| model.valid(i, q)).collect();
                valid.iter().for_each(|v| tally.judged(*v));
                let receipts: Vec<Receipt> = batch.iter().map(|i| i.receipt.clone()).collect();
                let stale = queues[q]
                    .delete_batch(&receipts)
                    .await
                    .map_err(|e| format!("delete_batch {batch:?} in {q}: {e}"))?;
                let want: Vec<Receipt> = batch
                    .iter()
                    .zip(&valid)
                    .filter(|(_, v)| !**v)
                    .map(|(i, _)| i.receipt.clone())
                    .collect();
                if stale != want {
                    return Err(format!(
                        "delete_batch {batch:?} in {q}: stale {stale:?}, model {want:?}"
                    ));
                }
                for (i, v) in batch.iter().zip(valid) {
                    if v {
                        model.messages.remove(&i.id);
                    }
                }
            }
            Op::Redrive => {
                let moved = queues[DLQ]
                    .redrive()
                    .await
                    .map_err(|e| format!("redrive: {e}"))?;
                let mut want = 0;
                for m in model.messages.values_mut() {
                    if m.queue == DLQ && m.visible && m.from.is_some() {
                        m.queue = m.from.take().unwrap();
                        m.base = m.receive_count;
                        m.delivery = None;
                        want += 1;
                    }
                }
                if moved != want {
                    return Err(format!("redrove {moved}, model {want}"));
                }
                tally.redriven += want;
            }
            Op::Purge(q) => {
                let purged = queues[*q]
                    .purge()
                    .await
                    .map_err(|e| format!("purge: {e}"))?;
                let before = model.messages.len();
                model.messages.retain(|_, m| m.queue != *q);
                let want = (before - model.messages.len()) as u64;
                if purged != want {
                    return Err(format!("purged {purged}, model {want}"));
                }
                tally.purged += want;
            }
            Op::SetMaxReceives(q, n) => {
                let names: Vec<String> = queues.iter().map(|q| q.name().to_string()).collect();
                let attributes = QueueAttributes::default().visibility_timeout(LONG);
                let attributes = match n {
                    0 => attributes,
                    n => attributes.dead_letter(names[DLQ].clone(), *n),
                };
                PgQueue::create(pool, &names[*q], attributes, fast_poll())
                    .await
                    .map_err(|e| format!("set the redrive policy: {e}"))?;
                model.max_receives[*q] = (*n > 0).then_some(*n);
                tally.policies_set += 1;
            }
        }
        Ok(())
    }

    /// The rows of the queues under test against the model's messages
    /// (`rows_match`).
    async fn compare(pool: &PgPool, names: &[String; 3], model: &Model) -> Result<(), String> {
        let rows = read_rows(pool, names).await?;
        rows_match(&rows, names, &model.messages, |m| {
            (m.queue, m.visible, m.receive_count)
        })
    }

    async fn run(pool: &PgPool, case: u64, ops: &[Op], tally: &mut Tally) -> Result<(), String> {
        let names = [
            format!("m{case}-a"),
            format!("m{case}-b"),
            format!("m{case}-dlq"),
        ];
        let dlq = queue(
            pool,
            &names[2],
            QueueAttributes::default().visibility_timeout(LONG),
        )
        .await;
        let source = |max| {
            QueueAttributes::default()
                .visibility_timeout(LONG)
                .dead_letter(names[2].clone(), max)
        };
        let queues = [
            queue(pool, &names[0], source(MAX_RECEIVES[0])).await,
            queue(pool, &names[1], source(MAX_RECEIVES[1])).await,
            dlq,
        ];
        let mut model = Model::default();
        for text in ["", "junk", "1.1", "1:1"]
            .into_iter()
            .map(String::from)
            .chain([
                format!("{}:x:1", names[0]),
                format!("{}:1:2:3", names[0]),
                format!("{}:999999999:1", names[0]),
            ])
        {
            model.receipts.push(Issued {
                receipt: Receipt(text),
                queue: None,
                id: String::new(),
                delivery: 0,
            });
        }
        let apply = async |model: &mut Model, op: &Op| step(pool, &queues, model, op, tally).await;
        let check = async |model: &Model| compare(pool, &names, model).await;
        step_and_compare(&mut model, ops, apply, check).await
    }

    #[test]
    fn receipts_act_only_on_their_own_delivery_in_their_own_queue() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (db, pool) = rt.block_on(fresh_migrated_database(4, pgonce::migrate));
        crate::support::check_model(
            file!(),
            64,
            proptest::collection::vec(op(), 1..80),
            Tally::default(),
            |case, ops, tally| rt.block_on(run(&pool, case, ops, tally)),
        );
        drop(db);
    }
}

/// The LISTEN sessions on the current database, by application name.
async fn listeners(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT coalesce(application_name, '') FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// `Listen::Off` opens no LISTEN connection (long polls only re-poll);
/// `Listen::Direct` puts it on those options, not on the pool (behind a
/// transaction-mode pooler, the pool's connections cannot LISTEN).
#[tokio::test]
async fn listen_can_be_turned_off_or_sent_to_a_direct_url() {
    let (db, pool) = fresh_migrated_database(4, pgonce::migrate).await;
    let poll = ReceiveRequest::up_to(1).wait(Duration::from_millis(30));

    let off = PgQueueOptions {
        listen: pgonce::Listen::Off,
        poll_interval: Duration::from_millis(10),
        ..PgQueueOptions::default()
    };
    let q = PgQueue::create(&pool, "off", QueueAttributes::default(), off)
        .await
        .unwrap();
    assert!(q.receive(poll).await.unwrap().is_empty());
    q.send(SendMessage::new("found by polling")).await.unwrap();
    let got = q.receive(poll).await.unwrap();
    assert_eq!(got.len(), 1);
    assert!(listeners(&pool).await.is_empty());

    let direct = PgQueueOptions {
        listen: pgonce::Listen::Direct(Box::new(
            db.options().application_name("pgonce_direct_listener"),
        )),
        ..PgQueueOptions::default()
    };
    let q = PgQueue::create(&pool, "direct", QueueAttributes::default(), direct)
        .await
        .unwrap();
    assert!(q.receive(poll).await.unwrap().is_empty());
    assert_eq!(listeners(&pool).await, ["pgonce_direct_listener"]);
}

/// Holds back every connection a pool hands out (fresh or idle) while
/// closed, and says when one arrives: lets a test see a woken receiver
/// about to look, and hold it there for as long as it needs.
struct Gate {
    open: tokio::sync::watch::Sender<bool>,
    arrived: tokio::sync::Notify,
}

impl Gate {
    /// A pool of `db`'s connections, each handed out through `gate`.
    async fn pool(db: &pgonce_testkit::ScratchDatabase) -> (PgPool, std::sync::Arc<Gate>) {
        let gate = std::sync::Arc::new(Gate {
            open: tokio::sync::watch::channel(true).0,
            arrived: tokio::sync::Notify::new(),
        });
        let (fresh, idle) = (gate.clone(), gate.clone());
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .after_connect(move |_, _| {
                let gate = fresh.clone();
                Box::pin(async move {
                    gate.pass().await;
                    Ok(())
                })
            })
            .before_acquire(move |_, _| {
                let gate = idle.clone();
                Box::pin(async move {
                    gate.pass().await;
                    Ok(true)
                })
            })
            .connect_with(db.options())
            .await
            .unwrap();
        (pool, gate)
    }

    async fn pass(&self) {
        let mut open = self.open.subscribe();
        if !*open.borrow() {
            self.arrived.notify_one();
            open.wait_for(|open| *open).await.unwrap();
        }
    }
}

/// A receive of one message from `q`, waiting up to `wait`: what it got,
/// and how long it took.
fn spawn_receive(
    q: &PgQueue,
    wait: Duration,
) -> tokio::task::JoinHandle<(Vec<Received>, Duration)> {
    let q = q.clone();
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        let got = q
            .receive(ReceiveRequest::up_to(1).wait(wait))
            .await
            .unwrap();
        (got, started.elapsed())
    })
}

/// Until a receive of `q` is parked and its listener LISTENing.
async fn parked_and_listening(q: &PgQueue, plain: &PgPool) {
    wait_until("a receive parked and its listener LISTENing", || async {
        q.parked_receivers() > 0 && !listeners(plain).await.is_empty()
    })
    .await;
}

/// Terminates the backend of the one queue listener.
async fn terminate_listener(plain: &PgPool) {
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_all(plain)
    .await
    .unwrap();
    assert_eq!(killed, [true]);
}

/// Sends to queue `q` and commits, while nobody listens: the notification
/// is lost.
async fn send_unannounced(plain: &PgPool) -> Sent {
    let sender = PgQueue::open(plain, "q", slow_poll()).await.unwrap();
    let mut tx = plain.begin().await.unwrap();
    let sent = sender
        .send_in(&mut tx, SendMessage::new("sent while nobody listened"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sent
}

/// The receive got `sent`, woken before its `wait` ended. Nothing else
/// ends the park before the wait: the poll interval (60 s) is longer, and
/// the notification was lost.
async fn received_before_the_wait(
    receiver: tokio::task::JoinHandle<(Vec<Received>, Duration)>,
    sent: &Sent,
    wait: Duration,
) {
    let (got, took) = receiver.await.unwrap();
    assert_eq!(
        got.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        [sent.id.as_str()]
    );
    assert!(
        took < wait,
        "woken once the listener was back, not by the end of the wait: {took:?}"
    );
}

/// The listener of a long poll loses its connection (its backend
/// terminated) and a message is sent and committed before it has
/// reconnected: that notification is lost. The listener, once it has
/// LISTENed again, wakes the parked receivers to look, so the message is
/// received before the poll interval (60 s) or the wait (30 s) ends.
#[tokio::test]
async fn a_listener_that_reconnected_wakes_the_parked_receivers_for_what_it_missed() {
    let (db, plain) = fresh_migrated_database(4, pgonce::migrate).await;
    let mut proxy = FaultProxy::start(db.options(), NewConnections::HandOver)
        .await
        .unwrap();
    let q = listening_through(&proxy, &plain).await;
    let wait = Duration::from_secs(30);
    let receiver = spawn_receive(&q, wait);
    proxy.next_connection().await.forward();
    parked_and_listening(&q, &plain).await;

    terminate_listener(&plain).await;
    // The listener saw its connection die and is reconnecting: held back
    // while a message is sent.
    let reconnect = proxy.next_connection().await;
    let sent = send_unannounced(&plain).await;
    reconnect.forward();

    received_before_the_wait(receiver, &sent, wait).await;
}

/// Creates queue `q` on `pool`, its listener connecting through `proxy`;
/// re-polls once a minute ([`slow_poll`]).
async fn listening_through(proxy: &FaultProxy, pool: &PgPool) -> PgQueue {
    let options = PgQueueOptions {
        listen: pgonce::Listen::Direct(Box::new(proxy.options())),
        ..slow_poll()
    };
    PgQueue::create(pool, "q", QueueAttributes::default(), options)
        .await
        .unwrap()
}

/// The listener of a long poll loses its connection and cannot get a new
/// one at first (its reconnect fails, as when the server is down longer
/// than the pool's acquire timeout): the receivers are woken, look, find
/// nothing and park again. A message is then sent and committed while the
/// listener's next try is held back, so its notification is lost. Once
/// that try goes through and the listener LISTENs again, the receivers are
/// woken to look, and the message is received before the poll interval
/// (60 s) or the wait (20 s) ends. Before, the listener came back inside
/// its next `try_recv` without a word, and the receiver slept out the wait.
#[tokio::test]
async fn a_listener_back_after_a_failed_reconnect_wakes_the_parked_receivers() {
    let (db, plain) = fresh_migrated_database(4, pgonce::migrate).await;
    let (gated, gate) = Gate::pool(&db).await;
    let mut proxy = FaultProxy::start(db.options(), NewConnections::HandOver)
        .await
        .unwrap();
    let q = listening_through(&proxy, &gated).await;
    let wait = Duration::from_secs(20);
    let receiver = spawn_receive(&q, wait);
    proxy.next_connection().await.forward();
    parked_and_listening(&q, &plain).await;

    gate.open.send_replace(false);
    terminate_listener(&plain).await;
    // The listener's reconnect fails, and the receiver is woken.
    proxy.next_connection().await.refuse();
    gate.arrived.notified().await;
    assert_eq!(q.parked_receivers(), 0);
    gate.open.send_replace(true);
    // It looked, found nothing, and parked again.
    wait_until("a receive parked", || async { q.parked_receivers() > 0 }).await;

    // The listener's next try, held back while a message is sent.
    let retry = proxy.next_connection().await;
    let sent = send_unannounced(&plain).await;
    retry.forward();

    received_before_the_wait(receiver, &sent, wait).await;
}

/// A send waits for its FIFO group's lock as long as it takes, as
/// `send_in` promises ("other sends to that group wait"), whatever
/// lock_timeout the session inherited (an operator's `ALTER ROLE ... SET
/// lock_timeout`; here set on the session): a send, a batch, and a batch
/// with deduplication ids (which takes its keys first) are each still
/// waiting at four times that timeout, and go through once the holder's
/// transaction commits. Inheriting it, each failed after 50 ms with
/// PostgreSQL's 55P03 as a database error.
#[tokio::test]
async fn a_send_waits_for_its_group_past_the_sessions_lock_timeout() {
    let (db, pool) = fresh_migrated_database(4, pgonce::migrate).await;
    queue(&pool, "f", QueueAttributes::fifo()).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (h, w) = (
        race.session("H").await.unwrap(),
        race.session("W").await.unwrap(),
    );
    w.set("lock_timeout", "50ms").await.unwrap();
    let holder_q = PgQueue::open(h.pool(), "f", fast_poll()).await.unwrap();
    let waiter_q = PgQueue::open(w.pool(), "f", fast_poll()).await.unwrap();
    for case in ["send", "send_batch", "send_batch with dedup ids"] {
        let mut holder = h.pool().begin().await.unwrap();
        let holding = holder_q.send_in(&mut holder, SendMessage::new("first").group("g"));
        race.step(&h, "send_in(g)", holding).await.unwrap().unwrap();
        let q = waiter_q.clone();
        let waiting = race
            .step_blocks(&w, case, async move {
                let second = SendMessage::new("second").group("g");
                match case {
                    "send" => q.send(second).await.map(|_| ()),
                    "send_batch" => q.send_batch(vec![second]).await.map(|_| ()),
                    _ => q.send_batch(vec![second.dedup("d")]).await.map(|_| ()),
                }
            })
            .await
            .unwrap();
        waiting
            .outlasts_then_commit(200, &h, holder)
            .await
            .unwrap_or_else(|e| panic!("{case}: {e}"))
            .unwrap();
    }
}

/// A message's receipt as its row holds it.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
struct ReceiptRow {
    id: i64,
    generation: i64,
}

/// The statements a receipt runs, each with its parameters for one receipt
/// of `queue` or all of them: delete, change visibility, delete several.
fn receipt_statements(queue: &str, receipts: &[ReceiptRow]) -> Vec<(&'static str, String)> {
    let ReceiptRow { id, generation } = receipts[0];
    let ids: Vec<String> = receipts.iter().map(|r| r.id.to_string()).collect();
    let generations: Vec<String> = receipts.iter().map(|r| r.generation.to_string()).collect();
    vec![
        (
            include_str!("../src/queue/sql/delete.sql"),
            format!("'{queue}', {id}, {generation}"),
        ),
        (
            include_str!("../src/queue/sql/change_visibility.sql"),
            // A standard queue's handle ($5, the handle's kind).
            format!("'{queue}', {id}, {generation}, 1000, false"),
        ),
        (
            include_str!("../src/queue/sql/delete_batch.sql"),
            format!(
                "'{queue}', '{{{}}}'::bigint[], '{{{}}}'::bigint[]",
                ids.join(","),
                generations.join(",")
            ),
        ),
    ]
}

/// Rows a plan node and its children handle over all their loops: what
/// each returns plus what its filters throw away (EXPLAIN's JSON gives both
/// per loop). `relation`: count only the scans of that table. The DELETE
/// or UPDATE node itself reads nothing.
fn rows_handled(node: &serde_json::Value, relation: Option<&str>) -> f64 {
    let counted =
        node["Node Type"] != "ModifyTable" && relation.is_none_or(|r| node["Relation Name"] == r);
    let own = if counted {
        let loops = node["Actual Loops"].as_f64().unwrap_or(1.0);
        (node["Actual Rows"].as_f64().unwrap_or(0.0)
            + node["Rows Removed by Filter"].as_f64().unwrap_or(0.0)
            + node["Rows Removed by Index Recheck"]
                .as_f64()
                .unwrap_or(0.0))
            * loops
    } else {
        0.0
    };
    let children: f64 = node["Plans"]
        .as_array()
        .map(|plans| plans.iter().map(|p| rows_handled(p, relation)).sum())
        .unwrap_or(0.0);
    own + children
}

/// `EXPLAIN (ANALYZE, FORMAT JSON)` of `statement` run as a prepared
/// statement with `types` and `values`, under `plan_mode`
/// (`force_custom_plan`: the plan made for these values, as the first five
/// runs get; `force_generic_plan`: the one reused after them), in a
/// transaction rolled back afterwards. The statements are the library's
/// own text and the values the test's constants.
async fn explain_prepared(
    conn: &mut sqlx::PgConnection,
    plan_mode: &str,
    types: &str,
    statement: &str,
    values: &str,
) -> serde_json::Value {
    prepare_in_transaction(conn, plan_mode, types, statement).await;
    let plan = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE prepared({values})"
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    roll_back_prepared(conn).await;
    plan
}

/// Begins a transaction on `conn` and prepares `statement` (parameter
/// `types`) in it as `prepared`, planned under `plan_mode`, as sqlx runs a
/// statement; [`roll_back_prepared`] undoes both.
async fn prepare_in_transaction(
    conn: &mut sqlx::PgConnection,
    plan_mode: &str,
    types: &str,
    statement: &str,
) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; SET LOCAL plan_cache_mode = {plan_mode};
         PREPARE prepared ({types}) AS {statement};"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
}

async fn roll_back_prepared(conn: &mut sqlx::PgConnection) {
    sqlx::raw_sql("ROLLBACK; DEALLOCATE prepared;")
        .execute(&mut *conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_receipt_finds_its_message_by_primary_key_on_stale_statistics() {
    // Statistics taken while the queue held 5 messages, then 3,000 more
    // (autovacuum off, so they stay stale): the state a busy queue is in
    // between two ANALYZE runs. A receipt's statement must still read its
    // own message, not every message of the queue.
    let pool = pool().await;
    let q = queue(&pool, "busy", QueueAttributes::default()).await;
    sqlx::raw_sql(
        "ALTER TABLE pgonce.queue_message SET (autovacuum_enabled = false);
         INSERT INTO pgonce.queue_message (queue, body, visible_at)
         SELECT 'busy', 'early', now() FROM generate_series(1, 5);
         ANALYZE pgonce.queue_message;
         INSERT INTO pgonce.queue_message (queue, body, visible_at)
         SELECT 'busy', 'later', now() FROM generate_series(1, 3000);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(got.len(), 10);
    let receipts: Vec<ReceiptRow> = sqlx::query_as(
        "SELECT id, generation FROM pgonce.queue_message WHERE receive_count = 1 ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(receipts.len(), 10);

    let mut conn = pool.acquire().await.unwrap();
    // Both plans a prepared statement can get: one made for its values
    // (the first five runs) and the generic one reused after them.
    for plan_mode in ["force_custom_plan", "force_generic_plan"] {
        for (n, (statement, values)) in receipt_statements("busy", &receipts)
            .into_iter()
            .enumerate()
        {
            let types = match n {
                0 => "text, bigint, bigint",
                1 => "text, bigint, bigint, bigint, boolean",
                _ => "text, bigint[], bigint[]",
            };
            let plan = explain_prepared(&mut conn, plan_mode, types, statement, &values).await;
            let read = rows_handled(&plan[0]["Plan"], Some("queue_message"));
            // A visibility change reads its message twice by primary key:
            // the time it was to become visible, then the row it updates
            // (change_visibility.sql).
            let expected = match n {
                0 => 1,
                1 => 2,
                _ => receipts.len(),
            } as f64;
            assert!(
                read <= expected,
                "{plan_mode}: statement {n} read {read} message rows for {expected} receipts:\n{plan:#}"
            );
        }
    }
}

#[tokio::test]
async fn a_standard_receive_keeps_its_plan_on_a_backlogged_queue() {
    // A backlog of 3,000, statistics fresh. A plan made for a receive's own
    // limit costs less than a generic plan, which must assume a tenth of
    // the backlog; with the limit in the receive statement PostgreSQL
    // therefore made a new plan at every call (0.27 ms of planning for
    // 0.07 ms of work). The pick is a function with a fixed cost, so after
    // the five plans a prepared statement always gets, the generic one is
    // kept. One connection, so one session's statement serves every call.
    let (_db, pool) = fresh_migrated_database(1, pgonce::migrate).await;
    let q = queue(&pool, "backlog", QueueAttributes::default()).await;
    sqlx::raw_sql(
        "INSERT INTO pgonce.queue_message (queue, body, visible_at)
         SELECT 'backlog', 'm', now() FROM generate_series(1, 3000);
         ANALYZE pgonce.queue_message;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let receives = 12;
    for _ in 0..receives {
        assert_eq!(q.receive(ReceiveRequest::up_to(1)).await.unwrap().len(), 1);
    }
    #[derive(sqlx::FromRow, Debug)]
    struct Plans {
        generic_plans: i64,
        custom_plans: i64,
    }
    let plans: Vec<Plans> = sqlx::query_as(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements
         WHERE statement LIKE '-- Receive, in one statement%'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(plans.len(), 1, "one receive statement prepared: {plans:?}");
    assert!(
        plans[0].custom_plans <= 5 && plans[0].generic_plans == receives - plans[0].custom_plans,
        "the receive was planned again after its first five calls: {plans:?}"
    );
}

#[tokio::test]
async fn a_full_delete_batch_does_work_linear_in_its_receipts() {
    // MAX_BATCH receipts: matching each message with its receipt must not
    // scan the whole batch once per message (a correlated sub-select did:
    // 502,000 rows handled for 1,000 receipts).
    let pool = pool().await;
    let _q = queue(&pool, "big", QueueAttributes::default()).await;
    let n: i64 = 1000; // the most receipts one delete_batch takes
    sqlx::query(
        "INSERT INTO pgonce.queue_message (queue, body, visible_at, generation)
         SELECT 'big', 'm', now(), 1 FROM generate_series(1, $1)",
    )
    .bind(n)
    .execute(&pool)
    .await
    .unwrap();
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM pgonce.queue_message ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let generations = vec![1i64; ids.len()];
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
    let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) {}",
        include_str!("../src/queue/sql/delete_batch.sql")
            .replace("$1", "'big'")
            .replace("$2", "$1")
            .replace("$3", "$2")
    )))
    .bind(&ids)
    .bind(&generations)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
    let work = rows_handled(&plan[0]["Plan"], None);
    assert!(
        work <= 10.0 * n as f64,
        "{work} rows handled for {n} receipts:\n{plan:#}"
    );
}

#[tokio::test]
async fn delete_batch_with_repeated_stale_and_foreign_receipts() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let p = queue(&pool, "p", QueueAttributes::default()).await;
    q.send(SendMessage::new("m")).await.unwrap();
    p.send(SendMessage::new("other")).await.unwrap();
    let first = q.receive(ReceiveRequest::up_to(1)).await.unwrap().remove(0);
    q.change_visibility(&first.receipt, Duration::ZERO)
        .await
        .unwrap();
    let second = q.receive(ReceiveRequest::up_to(1)).await.unwrap().remove(0);
    let foreign = p.receive(ReceiveRequest::up_to(1)).await.unwrap().remove(0);
    // The other queue's message under this queue's name.
    let (_, rest) = foreign.receipt.0.split_once(':').unwrap();
    let renamed = Receipt(format!("q:{rest}"));
    let batch = [
        first.receipt.clone(),
        second.receipt.clone(),
        second.receipt.clone(),
        first.receipt.clone(),
        foreign.receipt.clone(),
        renamed.clone(),
    ];
    let stale = q.delete_batch(&batch).await.unwrap();
    assert_eq!(
        stale,
        [
            first.receipt.clone(),
            first.receipt.clone(),
            foreign.receipt.clone(),
            renamed
        ]
    );
    assert_eq!(q.stats().await.unwrap().in_flight, 0, "q's message deleted");
    assert_eq!(
        p.stats().await.unwrap().in_flight,
        1,
        "p's message untouched"
    );
}

/// A batch holding a receipt (generation g) and the next one (g + 1,
/// guessed: receipts are plain text) runs while a delivery that bumps the
/// message to g + 1 is uncommitted, step by step: B's batch waits for A
/// (seen in pg_blocking_pids). After A commits, PostgreSQL re-checks the
/// new row version against the receipt it had matched (g): nothing is
/// deleted and both receipts are stale, as before the batch read by
/// primary key. (A sub-select re-run on the new version deleted it with the
/// guessed g + 1.)
#[tokio::test]
async fn delete_batch_rechecks_the_matched_receipt_after_a_concurrent_delivery() {
    let (_db, race, mut sessions) = raced(QueueAttributes::default(), &["A", "B"]).await;
    let (b, qb) = sessions.pop().unwrap();
    let (a, qa) = sessions.pop().unwrap();
    qa.send(SendMessage::new("m")).await.unwrap();
    let got = qa
        .receive(ReceiveRequest::up_to(1))
        .await
        .unwrap()
        .remove(0);
    let mut parts = got.receipt.0.rsplitn(3, ':');
    let generation: i64 = parts.next().unwrap().parse().unwrap();
    let id: i64 = parts.next().unwrap().parse().unwrap();
    let next = Receipt(format!("q:{id}:{}", generation + 1));

    let mut tx = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(
        &a,
        "deliver again, uncommitted",
        sqlx::query("UPDATE pgonce.queue_message SET generation = generation + 1 WHERE id = $1")
            .bind(id)
            .execute(&mut *tx),
    )
    .await
    .unwrap()
    .unwrap();
    let batch = [got.receipt.clone(), next.clone()];
    let waiting = race
        .step_blocks(&b, "delete both receipts", async move {
            qb.delete_batch(&batch).await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    race.step(&a, "commit", tx.commit()).await.unwrap().unwrap();
    let stale = waiting.resume().await.unwrap().unwrap();
    assert_eq!(stale, [got.receipt.clone(), next.clone()]);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.queue_message")
        .fetch_one(a.pool())
        .await
        .unwrap();
    assert_eq!(left, 1, "the message is kept");
}

/// A hand-back that lands after a concurrent heartbeat of the same
/// delivery wakes a receiver that saw the heartbeat's time, step by step.
/// m is delivered for 1 s; A extends its lease to an hour (a heartbeat,
/// uncommitted); C waits to lock the row behind A, and B's hand-back for
/// 2 s waits behind C (both seen in pg_blocking_pids). A commits, so C
/// holds the row and B still waits (seen). The long poll R then looks,
/// sees m visible in an hour and parks. C commits and B's hand-back lands:
/// m becomes visible 2 s from then, far sooner than the hour R waits for,
/// so B must wake R. B used to compare its new time with the row as its
/// statement's snapshot saw it before the wait (the 1 s lease, earlier
/// than 2 s from now): "not sooner", no notification, and R slept to its
/// poll interval with m visible.
#[tokio::test]
async fn a_hand_back_after_a_concurrent_heartbeat_wakes_a_long_poll() {
    let (db, race, mut sessions) = raced(QueueAttributes::default(), &["A", "C", "B"]).await;
    let (b, qb) = sessions.pop().unwrap();
    let (c, _) = sessions.pop().unwrap();
    let (a, _) = sessions.pop().unwrap();
    let receiver_pool = db.pool(2).await.unwrap();
    let r = PgQueue::open(&receiver_pool, "q", no_poll()).await.unwrap();
    qb.send(SendMessage::new("m")).await.unwrap();
    let got = qb
        .receive(ReceiveRequest::up_to(1).visibility(Duration::from_secs(1)))
        .await
        .unwrap()
        .remove(0);
    let id: i64 = got.id.parse().unwrap();

    let mut heartbeat = a.pool().begin().await.unwrap();
    race.step(
        &a,
        "extend the lease to an hour, uncommitted",
        sqlx::query(
            "UPDATE pgonce.queue_message SET visible_at = now() + interval '1 hour' \
             WHERE id = $1",
        )
        .bind(id)
        .execute(&mut *heartbeat),
    )
    .await
    .unwrap()
    .unwrap();
    let c_pool = c.pool().clone();
    let locker = race
        .step_blocks(&c, "lock the row", async move {
            let mut tx = c_pool.begin().await?;
            sqlx::query("SELECT 1 FROM pgonce.queue_message WHERE id = $1 FOR UPDATE")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            Ok::<_, sqlx::Error>(tx)
        })
        .await
        .unwrap();
    assert_eq!(locker.blocked_by(), ["A"]);
    let receipt = got.receipt.clone();
    let hand_back = race
        .step_blocks(&b, "hand back for 2 s", async move {
            qb.change_visibility(&receipt, Duration::from_secs(2)).await
        })
        .await
        .unwrap();
    race.step(&a, "commit", heartbeat.commit())
        .await
        .unwrap()
        .unwrap();
    let lock = locker.resume().await.unwrap().unwrap();
    assert_eq!(
        race.wait_until_blocked(&b, "hand back for 2 s, behind C")
            .await
            .unwrap(),
        ["C"]
    );
    let receiver = parked_receiver(&r).await;
    race.step(&c, "commit", lock.commit())
        .await
        .unwrap()
        .unwrap();
    hand_back.resume().await.unwrap().unwrap();
    let got = delivered(receiver, "a hand-back after a concurrent heartbeat").await;
    assert_eq!(bodies(&got), ["m"]);
}

/// The FIFO receive of up to 10 messages from `queue` (a name without
/// quotes), its first statement and a follow-up's, each explained under a
/// custom and then a generic plan.
async fn explain_fifo_receive(
    pool: &PgPool,
    queue: &str,
) -> Vec<(&'static str, serde_json::Value)> {
    let mut conn = pool.acquire().await.unwrap();
    let mut plans = Vec::new();
    for plan_mode in ["force_custom_plan", "force_generic_plan"] {
        // A receive's first statement, then a follow-up's (capped).
        for (statement, types, values) in [
            (
                FIFO_RECEIVE_FIRST,
                "text, bigint, bigint, bigint[]",
                format!("'{queue}', 10, NULL, '{{}}'"),
            ),
            (
                FIFO_RECEIVE,
                "text, bigint, bigint, bigint[], bigint",
                format!("'{queue}', 10, NULL, '{{}}', 10"),
            ),
        ] {
            let plan = explain_prepared(&mut conn, plan_mode, types, statement, &values).await;
            plans.push((plan_mode, plan));
        }
    }
    plans
}

#[tokio::test]
async fn a_fifo_receive_takes_redelivered_heads_before_their_followers() {
    // 200 groups of 50 messages each (sent round-robin), every head
    // received once and its visibility timeout run out: the state after a
    // consumer outage. 200 heads are receivable; finding 10 must not read
    // the 9,800 messages queued behind them. (Heads taken in visible_at
    // order fail this: a redelivered head became visible after its own
    // followers, 19,630 rows handled.)
    let pool = pool().await;
    let q = queue(&pool, "r.fifo", QueueAttributes::fifo()).await;
    sqlx::raw_sql(
        "INSERT INTO pgonce.queue_message (queue, body, group_id, sent_at, visible_at)
         SELECT 'r.fifo', 'm' || (i / 200), 'g' || (i % 200),
                now() - interval '1 hour' + i * interval '1 ms',
                now() - interval '1 hour' + i * interval '1 ms'
         FROM generate_series(0, 9999) AS i ORDER BY i;
         UPDATE pgonce.queue_message SET receive_count = 1, generation = 1,
                visible_at = now() - interval '1 minute'
         WHERE id IN (SELECT min(id) FROM pgonce.queue_message GROUP BY group_id);
         ANALYZE pgonce.queue_message;",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_a_fifo_receive_handles_at_most(&pool, "r.fifo", 500.0, "10 of 200 heads").await;
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(got.len(), 10);
    assert!(
        got.iter().all(|m| m.body == "m0"),
        "each group's first message"
    );
}

#[tokio::test]
async fn a_fifo_receive_reads_its_own_queue_only() {
    // Messages of a standard queue with lower ids than a FIFO queue's (as
    // when the busy queue was there first). Finding the FIFO queue's heads
    // should read the FIFO queue's messages, not walk every queue's
    // messages in id order (3,020 rows handled through the primary key,
    // generic plan).
    let pool = pool().await;
    let q = busy_queue_then_fifo(&pool, "own.fifo", 40, 20).await;
    assert_a_fifo_receive_handles_at_most(&pool, "own.fifo", 200.0, "10 heads in a queue of 40")
        .await;
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(got.len(), 10);
    assert!(got.iter().all(|m| m.body == "mine"));
}

#[tokio::test]
async fn a_fifo_receive_probes_each_group_of_a_queue_the_statistics_never_saw() {
    // Statistics taken while only a standard queue had messages, then a
    // FIFO queue created and filled: 2,000 messages over 1,000 groups, the
    // first 80 in flight (as in `pgonce bench queue`, whose FIFO queue
    // comes after its standard ones). The planner expects the FIFO queue
    // to hold about one message. The probe for an earlier message of the
    // group must still be a lookup of the group in queue_message_group,
    // not a walk of the whole queue through queue_message_fifo_walk (that
    // read 20,000 rows to find 10 heads, and slowed the bench's FIFO
    // receives from under 1 ms to 25-100 ms).
    let pool = pool().await;
    queue(&pool, "busy", QueueAttributes::default()).await;
    let q = queue(&pool, "new.fifo", QueueAttributes::fifo()).await;
    analyze_then_a_fifo_burst(
        &pool,
        "INSERT INTO pgonce.queue_message (queue, body, visible_at)
         SELECT 'busy', 'other', now() FROM generate_series(1, 3000);",
        "new.fifo",
    )
    .await;
    for (plan_mode, plan) in explain_fifo_receive(&pool, "new.fifo").await {
        assert_the_probe_looks_up_the_group(plan_mode, &plan);
        let handled = rows_handled(&plan[0]["Plan"], Some("queue_message"));
        assert!(
            handled <= 1000.0,
            "{plan_mode}: {handled} message rows handled to find 10 heads:\n{plan:#}"
        );
    }
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(got.len(), 10);
}

#[tokio::test]
async fn a_fifo_receive_on_few_groups_probes_the_group_not_the_table() {
    // Fresh statistics: a standard queue's 3,000 messages, then a FIFO
    // queue of 10,000 messages over 3 groups. Each group holds a quarter of
    // the table, so the planner expected a sequential scan to find an
    // earlier message of the group at once, and scanned the table once per
    // candidate: 30 million rows handled, 2.5 s for a receive. It must
    // look the group up instead: at most two rows per candidate.
    let pool = pool().await;
    let q = busy_queue_then_fifo(&pool, "few.fifo", 10_000, 3).await;
    for (plan_mode, plan) in explain_fifo_receive(&pool, "few.fifo").await {
        assert_the_probe_looks_up_the_group(plan_mode, &plan);
        let handled = rows_handled(&plan[0]["Plan"], Some("queue_message"));
        assert!(
            handled <= 3.0 * 10_000.0,
            "{plan_mode}: {handled} message rows handled to find 3 heads among 10,000"
        );
    }
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(got.len(), 3, "one head per group");
}

#[tokio::test]
async fn a_fifo_receive_on_one_long_group_reads_a_bounded_part_of_it() {
    // One group of 20,000 messages: a FIFO queue used for one strict
    // order, with a backlog. A receive of 10 finds the one head; a walk
    // that went on looking for nine more read the whole backlog (60,000
    // buffers, 250 ms per receive), and did so again at every poll while
    // the head was in flight. The walk stops at its window of 32
    // messages per message asked for; a group's head beyond it is found by the skip, one index
    // descent per group.
    let pool = pool().await;
    let q = queue(&pool, "long.fifo", QueueAttributes::fifo()).await;
    sqlx::raw_sql(
        "INSERT INTO pgonce.queue_message (queue, body, group_id, visible_at)
         SELECT 'long.fifo', 'm', 'one', now() FROM generate_series(1, 20000);
         ANALYZE pgonce.queue_message;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let bound = 2_000.0;
    assert_a_fifo_receive_handles_at_most(&pool, "long.fifo", bound, "the head of one group").await;
    let got = q
        .receive(ReceiveRequest::up_to(10).visibility(Duration::from_secs(3600)))
        .await
        .unwrap();
    assert_eq!(got.len(), 1, "one group, one head");
    // The head in flight: nothing is receivable, and finding that out is
    // as cheap.
    assert_a_fifo_receive_handles_at_most(&pool, "long.fifo", bound, "no head").await;
    assert!(
        q.receive(ReceiveRequest::up_to(10))
            .await
            .unwrap()
            .is_empty()
    );
    // Deleted, its follower is the head, and is delivered.
    q.delete(&got[0].receipt).await.unwrap();
    let next = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(next.len(), 1);
    assert!(next[0].id.parse::<i64>().unwrap() > got[0].id.parse::<i64>().unwrap());
}

/// A FIFO receive of 10 from `queue`, explained (both statements, both
/// plan modes), handles at most `bound` message rows to find `what`.
async fn assert_a_fifo_receive_handles_at_most(pool: &PgPool, queue: &str, bound: f64, what: &str) {
    for (plan_mode, plan) in explain_fifo_receive(pool, queue).await {
        let handled = rows_handled(&plan[0]["Plan"], Some("queue_message"));
        assert!(
            handled <= bound,
            "{plan_mode}: {handled} message rows handled to find {what} in {queue}:\n{plan:#}"
        );
    }
}

#[tokio::test]
async fn a_fifo_receive_finds_each_head_once_at_the_edge_of_the_walk() {
    // A receive of 3 walks the queue's oldest 96 messages, then skips
    // through the groups for heads newer than those. Group "long" fills
    // the window but for its last message, its head in flight; the
    // window's last message is the head of "b", and "c"'s head comes right
    // after. The walk finds b's head; the skip must find c's, and not b's
    // again.
    let pool = pool().await;
    let q = behind_a_long_group(&pool, "edge.fifo", 95, &["b", "c"]).await;
    let got = q.receive(ReceiveRequest::up_to(3)).await.unwrap();
    let bodies: Vec<&str> = got.iter().map(|m| m.body.as_str()).collect();
    assert_eq!(
        bodies,
        ["b", "c"],
        "b's head from the walk, c's from the skip"
    );
}

#[tokio::test]
async fn a_fifo_receive_beyond_the_walk_passes_over_a_head_another_receiver_holds() {
    // Group "long" fills a receive of 1's window (32 messages), its head
    // in flight; then one message each to g1, g2, g3, beyond the window.
    // A receiver holds g1's head locked mid-receive. A receive of 1 must
    // take g2's head, not come back empty because the one candidate the
    // skip offered was locked.
    let pool = pool().await;
    let q = behind_a_long_group(&pool, "held.fifo", 40, &["g1", "g2", "g3"]).await;
    let mut other = pool.begin().await.unwrap();
    sqlx::query(
        "SELECT 1 FROM pgonce.queue_message WHERE queue = 'held.fifo' AND group_id = 'g1'
         FOR UPDATE",
    )
    .execute(&mut *other)
    .await
    .unwrap();
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    let bodies: Vec<&str> = got.iter().map(|m| m.body.as_str()).collect();
    assert_eq!(bodies, ["g2"], "the next group's head, g1's being held");
    other.rollback().await.unwrap();
}

/// A FIFO receive that found a group's head and, before locking it, the
/// head was moved out of the queue and back behind a message of its group
/// now in flight (as a dead-letter move and a redrive do). The receive's
/// snapshot still shows it as its group's head and cannot see the message
/// ahead of it: it must leave it, not deliver it beside that message.
///
/// Step by step: T1 and T2 begin (so their `now()` comes before the
/// receive's, and the moved head is visible to it). R's receive of 1
/// finds g's head m through the skip (its window, 32 messages of group
/// "long", holds no head) and waits inside the skip for an advisory lock H
/// holds (the function is replaced by a copy that takes that lock first;
/// seen in pg_blocking_pids). T1 moves m to the dead-letter queue and
/// commits; f is sent to g and received; T2 moves m back behind f, visible
/// as of its `now()`, and commits. H lets go; R's receive goes on. (A lock
/// step that re-checked only the queue and visibility on m's newest
/// version delivered it: m and f in flight at once.)
#[tokio::test]
async fn a_fifo_head_moved_behind_an_in_flight_message_while_a_receive_looks_is_left() {
    let db = fresh_database().await;
    let setup = db.pool(4).await.unwrap();
    pgonce::migrate(&setup).await.unwrap();
    queue(&setup, "moved-dlq.fifo", QueueAttributes::fifo()).await;
    let q = behind_a_long_group(&setup, "moved.fifo", 40, &[]).await;
    sqlx::raw_sql(
        "DO $$
         DECLARE definition text;
         BEGIN
             definition := pg_get_functiondef(
                 'pgonce.queue_fifo_heads_after(text, bigint, bigint, bigint[])'::regprocedure);
             EXECUTE replace(definition, E'BEGIN\n',
                             E'BEGIN\n    PERFORM pg_advisory_xact_lock_shared(4242);\n');
         END $$;",
    )
    .execute(&setup)
    .await
    .unwrap();
    let m: i64 = q
        .send(SendMessage::new("m").group("g"))
        .await
        .unwrap()
        .id
        .parse()
        .unwrap();
    let race = pgonce_testkit::Interleaving::new(db.options())
        .await
        .unwrap();
    let (h, r) = (
        race.session("H").await.unwrap(),
        race.session("R").await.unwrap(),
    );
    let (t1, t2) = (
        race.session("T1").await.unwrap(),
        race.session("T2").await.unwrap(),
    );
    let mut t1x = race
        .step(&t1, "begin", t1.pool().begin())
        .await
        .unwrap()
        .unwrap();
    let mut t2x = race
        .step(&t2, "begin", t2.pool().begin())
        .await
        .unwrap()
        .unwrap();
    race.step(
        &h,
        "hold the skip's lock",
        sqlx::query("SELECT pg_advisory_lock(4242)").execute(h.pool()),
    )
    .await
    .unwrap()
    .unwrap();
    let qr = PgQueue::open(r.pool(), "moved.fifo", fast_poll())
        .await
        .unwrap();
    let looking = race
        .step_blocks(&r, "receive 1 (held inside the skip)", async move {
            qr.receive(ReceiveRequest::up_to(1).visibility(Duration::from_secs(600)))
                .await
        })
        .await
        .unwrap();
    assert_eq!(looking.blocked_by(), ["H"]);
    race.step(
        &t1,
        "move m to the dead-letter queue",
        sqlx::query("UPDATE pgonce.queue_message SET queue = 'moved-dlq.fifo' WHERE id = $1")
            .bind(m)
            .execute(&mut *t1x),
    )
    .await
    .unwrap()
    .unwrap();
    t1x.commit().await.unwrap();
    q.send(SendMessage::new("f").group("g")).await.unwrap();
    let f = q
        .receive(ReceiveRequest::up_to(10).visibility(Duration::from_secs(600)))
        .await
        .unwrap();
    assert_eq!(bodies(&f), ["f"], "f is g's head, in flight");
    race.step(
        &t2,
        "move m back behind f",
        sqlx::query(
            "UPDATE pgonce.queue_message
             SET queue = 'moved.fifo', visible_at = now(),
                 group_position = nextval(pg_get_serial_sequence('pgonce.queue_message', 'id'))
             WHERE id = $1",
        )
        .bind(m)
        .execute(&mut *t2x),
    )
    .await
    .unwrap()
    .unwrap();
    t2x.commit().await.unwrap();
    race.step(
        &h,
        "let go",
        sqlx::query("SELECT pg_advisory_unlock(4242)").execute(h.pool()),
    )
    .await
    .unwrap()
    .unwrap();
    let got = looking.resume().await.unwrap().unwrap();
    assert!(
        bodies(&got).is_empty(),
        "delivered {:?} while f, ahead of m in g, is in flight",
        bodies(&got)
    );
}

/// FIFO queue `fifo` holding `long` messages of group "long", its head in
/// flight, then one message to each of `groups` (its body the group's
/// name): heads beyond a short window.
async fn behind_a_long_group(pool: &PgPool, fifo: &str, long: i32, groups: &[&str]) -> PgQueue {
    let q = queue(pool, fifo, QueueAttributes::fifo()).await;
    sqlx::query(
        "INSERT INTO pgonce.queue_message (queue, body, group_id, visible_at)
         SELECT $1, 'long', 'long',
                CASE WHEN i = 1 THEN now() + interval '1 hour' ELSE now() END
         FROM generate_series(1, $2) AS i ORDER BY i",
    )
    .bind(fifo)
    .bind(long)
    .execute(pool)
    .await
    .unwrap();
    for group in groups {
        sqlx::query(
            "INSERT INTO pgonce.queue_message (queue, body, group_id, visible_at)
             VALUES ($1, $2, $2, now())",
        )
        .bind(fifo)
        .bind(group)
        .execute(pool)
        .await
        .unwrap();
    }
    q
}

/// Autovacuum off (so the statistics stay as taken), `before` run, the
/// message table analyzed, then a burst of 2,000 messages into FIFO queue
/// `fifo` over 1,000 groups, the first 80 in flight.
async fn analyze_then_a_fifo_burst(pool: &PgPool, before: &str, fifo: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE pgonce.queue_message SET (autovacuum_enabled = false);
         {before}
         ANALYZE pgonce.queue_message;
         INSERT INTO pgonce.queue_message (queue, body, group_id, visible_at)
         SELECT '{fifo}', 'later', 'g' || (i % 1000),
                CASE WHEN i <= 80 THEN now() + interval '1 hour' ELSE now() END
         FROM generate_series(1, 2000) AS i;"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// A standard queue `busy` with 3,000 messages, then FIFO queue `fifo`
/// with `messages` over `groups` groups (body "mine"), all visible, and
/// the statistics taken then.
async fn busy_queue_then_fifo(pool: &PgPool, fifo: &str, messages: i32, groups: i32) -> PgQueue {
    queue(pool, "busy", QueueAttributes::default()).await;
    let q = queue(pool, fifo, QueueAttributes::fifo()).await;
    sqlx::query(
        "INSERT INTO pgonce.queue_message (queue, body, visible_at)
         SELECT 'busy', 'other', now() FROM generate_series(1, 3000)",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO pgonce.queue_message (queue, body, group_id, visible_at)
         SELECT $1, 'mine', 'g' || (i % $3), now() FROM generate_series(1, $2) AS i",
    )
    .bind(fifo)
    .bind(messages)
    .bind(groups)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE pgonce.queue_message")
        .execute(pool)
        .await
        .unwrap();
    q
}

/// Every index the head probe scans in `plan` is queue_message_group.
fn assert_the_probe_looks_up_the_group(plan_mode: &str, plan: &serde_json::Value) {
    let probes = index_scans_under_subplans(&plan[0]["Plan"]);
    assert!(
        !probes.is_empty() && probes.iter().all(|i| i == "queue_message_group"),
        "{plan_mode}: the head probe should look up the group, it used {probes:?}:\n{plan:#}"
    );
}

/// The indexes that the plan's sub-plans (the head probe) scan.
fn index_scans_under_subplans(node: &serde_json::Value) -> Vec<String> {
    fn indexes(node: &serde_json::Value, under_subplan: bool, found: &mut Vec<String>) {
        let under_subplan = under_subplan
            || node["Subplan Name"]
                .as_str()
                .is_some_and(|s| s.starts_with("SubPlan"));
        if under_subplan && let Some(index) = node["Index Name"].as_str() {
            found.push(index.to_string());
        }
        for child in node["Plans"].as_array().into_iter().flatten() {
            indexes(child, under_subplan, found);
        }
    }
    let mut found = Vec::new();
    indexes(node, false, &mut found);
    found
}

#[tokio::test]
async fn a_fifo_receive_probes_each_head_on_stale_statistics() {
    // A FIFO queue that was drained (3,000 messages deleted), analyzed at
    // 5 messages, then took a burst of 2,000 more over 1,000 groups, 80 of
    // them in flight (autovacuum off, so the statistics stay stale: the
    // planner expects a handful of messages). Finding the groups' heads
    // must cost a probe per candidate, not a comparison of every pair of
    // messages.
    let pool = pool().await;
    let q = queue(&pool, "f.fifo", QueueAttributes::fifo()).await;
    analyze_then_a_fifo_burst(
        &pool,
        "INSERT INTO pgonce.queue_message (queue, body, group_id, visible_at)
         SELECT 'f.fifo', 'drained', 'g' || i, now() FROM generate_series(1, 3000) AS i;
         DELETE FROM pgonce.queue_message;
         INSERT INTO pgonce.queue_message (queue, body, group_id, visible_at)
         SELECT 'f.fifo', 'early', 'g' || (i % 5), now() FROM generate_series(1, 5) AS i;",
        "f.fifo",
    )
    .await;
    for (plan_mode, plan) in explain_fifo_receive(&pool, "f.fifo").await {
        let handled = rows_handled(&plan[0]["Plan"], None);
        assert!(
            handled <= 10.0 * 2005.0,
            "{plan_mode}: {handled} rows handled to find 10 heads among 2,005 messages:\n{plan:#}"
        );
    }
    // And the receive itself still takes each group's head only.
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(got.len(), 10);
    let mut groups: Vec<_> = got.iter().map(|m| m.group_id.clone()).collect();
    groups.sort();
    groups.dedup();
    assert_eq!(groups.len(), 10, "one message per group");
}

/// A long poll sleeps until the earlier of its deadline and now plus
/// `poll_interval`: one of `Duration::MAX` overflowed the instant and
/// panicked the receive, and one under the documented least (1 ms) polled
/// the database in a busy loop. Both are refused by `open`, and by
/// `create` before it creates the queue.
#[tokio::test]
async fn a_poll_interval_out_of_range_is_refused_before_the_queue_is_touched() {
    let pool = pool().await;
    queue(&pool, "polled", QueueAttributes::default()).await;
    for poll_interval in [
        Duration::MAX,
        Duration::from_secs(13 * 3600),
        Duration::from_micros(999),
        Duration::ZERO,
    ] {
        let options = PgQueueOptions {
            poll_interval,
            ..PgQueueOptions::default()
        };
        match PgQueue::open(&pool, "polled", options.clone()).await {
            Err(Error::Invalid { .. }) => {}
            Err(e) => panic!("a poll interval of {poll_interval:?}: {e:?}"),
            Ok(q) => {
                let received = tokio::spawn(async move {
                    q.receive(ReceiveRequest::up_to(1).wait(Duration::from_millis(50)))
                        .await
                })
                .await;
                panic!("a poll interval of {poll_interval:?} was taken; a receive: {received:?}");
            }
        }
        let created = PgQueue::create(&pool, "unmade", QueueAttributes::default(), options).await;
        assert!(matches!(created, Err(Error::Invalid { .. })), "{created:?}");
        assert!(matches!(
            PgQueue::open(&pool, "unmade", fast_poll()).await,
            Err(Error::QueueNotFound { .. })
        ));
    }
}

/// A caller's transaction, shared with the step that sends in it, so that
/// the transaction outlives the step's future when that is dropped.
type SharedTx = std::sync::Arc<tokio::sync::Mutex<Transaction<'static, Postgres>>>;

/// Starts `send_batch_in` of one message with deduplication id `d` in the
/// caller's transaction `tx` (on session `caller`), sees it blocked by
/// `holder`'s send of the same id, and gives it up as a caller's own
/// timeout or `select!` would: its future is dropped where it waits.
async fn give_up_a_deduplicated_batch(
    race: &pgonce_testkit::Interleaving,
    caller: &pgonce_testkit::Session,
    q: &PgQueue,
    tx: &SharedTx,
    what: &str,
) {
    let (q, in_step) = (q.clone(), tx.clone());
    let sending = race
        .step_blocks(caller, what, async move {
            let mut tx = in_step.lock().await;
            q.send_batch_in(&mut tx, vec![SendMessage::new("w").dedup("d")])
                .await
        })
        .await
        .unwrap();
    assert_eq!(sending.blocked_by(), ["H"]);
    sending.cancel();
}

/// A deduplicated `send_batch_in` given up while it waits for its
/// deduplication id's lock, twice (a caller retrying under its own
/// timeout), must leave the caller's transaction as it was: its COMMIT
/// commits the writes made before, or fails. The batch ran in a savepoint
/// sqlx takes, whose guard, armed before sqlx counted the savepoint,
/// queued a plain ROLLBACK of the caller's whole transaction when the
/// second try was dropped while its SAVEPOINT waited behind the first
/// try's lock statement; the caller's COMMIT then did nothing and
/// reported success.
#[tokio::test]
async fn a_deduplicated_batch_given_up_in_a_transaction_leaves_its_earlier_writes() {
    let (db, setup) = database_with_queue("q", QueueAttributes::default()).await;
    sqlx::query("CREATE TABLE written_before (x int)")
        .execute(&setup)
        .await
        .unwrap();
    let race = pgonce_testkit::Interleaving::new(db.options())
        .await
        .unwrap();
    let h = race.session("H").await.unwrap();
    let w = race.session("W").await.unwrap();
    let qh = PgQueue::open(h.pool(), "q", fast_poll()).await.unwrap();
    let qw = PgQueue::open(w.pool(), "q", fast_poll()).await.unwrap();
    let mut holder = h.pool().begin().await.unwrap();
    race.try_step(
        &h,
        "send d in tx",
        qh.send_batch_in(&mut holder, vec![SendMessage::new("h").dedup("d")]),
    )
    .await
    .unwrap();

    let tx: SharedTx =
        std::sync::Arc::new(tokio::sync::Mutex::new(w.pool().begin().await.unwrap()));
    sqlx::query("INSERT INTO written_before VALUES (1)")
        .execute(&mut **tx.lock().await)
        .await
        .unwrap();
    give_up_a_deduplicated_batch(&race, &w, &qw, &tx, "send d in tx").await;
    give_up_a_deduplicated_batch(&race, &w, &qw, &tx, "send d in tx again").await;
    race.try_step(&h, "roll back", holder.rollback())
        .await
        .unwrap();

    // The steps given up let go of the transaction once their tasks are
    // dropped, which the runtime does when it gets to them.
    drop(tx.lock().await);
    let tx = std::sync::Arc::into_inner(tx)
        .expect("the steps given up hold the transaction no more")
        .into_inner();
    let committed = race.step(&w, "commit", tx.commit()).await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM written_before")
        .fetch_one(&setup)
        .await
        .unwrap();
    assert!(
        committed.is_err() || rows == 1,
        "the commit reported {committed:?} with {rows} of 1 earlier write committed"
    );
}

/// A deduplicated batch, sent in one statement, deduplicates within
/// itself as it does against earlier sends: the second message of an id in
/// the batch is a duplicate of the first (its id), a message of an id sent
/// before is a duplicate of that send, and the others are sent, in order.
#[tokio::test]
async fn a_batch_deduplicates_within_itself_and_against_earlier_sends() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let earlier = q.send(SendMessage::new("e").dedup("e")).await.unwrap();
    let sent = q
        .send_batch(vec![
            SendMessage::new("a").dedup("a"),
            SendMessage::new("a again").dedup("a"),
            SendMessage::new("e again").dedup("e"),
            SendMessage::new("plain"),
        ])
        .await
        .unwrap();
    let duplicates: Vec<bool> = sent.iter().map(|s| s.duplicate).collect();
    assert_eq!(duplicates, [false, true, true, false], "{sent:?}");
    assert_eq!(sent[1].id, sent[0].id);
    assert_eq!(sent[2].id, earlier.id);
    let first: i64 = sent[0].id.parse().unwrap();
    let last: i64 = sent[3].id.parse().unwrap();
    assert!(first < last, "ids are drawn in the batch's order: {sent:?}");
    assert_eq!(q.stats().await.unwrap().depth, 3);
}

/// A message as a receipt could change it: where it is, its delivery and
/// when it becomes visible.
#[derive(Debug, PartialEq, sqlx::FromRow)]
struct MessageState {
    id: i64,
    queue: String,
    generation: i64,
    receive_count: i32,
    visible_at: time::OffsetDateTime,
}

/// Every message of every queue, by id.
async fn message_states(pool: &PgPool) -> Vec<MessageState> {
    sqlx::query_as(
        "SELECT id, queue, generation, receive_count, visible_at
         FROM pgonce.queue_message ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// `receipt`, presented to `q` after `when`, is refused as stale by every
/// call that takes a receipt (a release, a hand-back with a delay, a hide
/// of 12 hours, a delete, a batch delete) and changes no message.
async fn stale_and_changes_nothing(pool: &PgPool, q: &PgQueue, receipt: &Receipt, when: &str) {
    let before = message_states(pool).await;
    for timeout in [
        Duration::ZERO,
        Duration::from_millis(300),
        Duration::from_secs(12 * 3600),
    ] {
        assert!(
            matches!(
                q.change_visibility(receipt, timeout).await,
                Err(Error::StaleReceipt { .. })
            ),
            "{receipt} changes the visibility ({timeout:?}) in {} {when}",
            q.name()
        );
    }
    assert!(
        matches!(q.delete(receipt).await, Err(Error::StaleReceipt { .. })),
        "{receipt} deletes in {} {when}",
        q.name()
    );
    let one = std::slice::from_ref(receipt);
    assert_eq!(
        q.delete_batch(one).await.unwrap(),
        one,
        "{receipt} is not stale in a batch in {} {when}",
        q.name()
    );
    assert_eq!(
        message_states(pool).await,
        before,
        "{receipt} changed a message {when}"
    );
}

/// A FIFO message's receipts across a dead-letter move and a redrive back
/// to its queue: each earlier delivery's receipt, in either queue, acts on
/// none of its later places.
#[tokio::test]
async fn fifo_receipts_do_not_follow_their_message_to_the_dead_letter_queue_and_back() {
    let pool = pool().await;
    let (f, dlq) = dead_lettering_at_second_receive(
        &pool,
        "f.fifo",
        "f-dlq.fifo",
        QueueAttributes::fifo(),
        fast_poll(),
    )
    .await;
    f.send(SendMessage::new("m").group("g")).await.unwrap();
    let first = f.receive(ReceiveRequest::up_to(1)).await.unwrap().remove(0);
    f.change_visibility(&first.receipt, Duration::ZERO)
        .await
        .unwrap();
    assert!(
        f.receive(ReceiveRequest::up_to(1))
            .await
            .unwrap()
            .is_empty()
    );
    for q in [&f, &dlq] {
        stale_and_changes_nothing(&pool, q, &first.receipt, "after the move").await;
    }
    let dead = dlq
        .receive(ReceiveRequest::up_to(1))
        .await
        .unwrap()
        .remove(0);
    dlq.change_visibility(&dead.receipt, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    let back = f.receive(ReceiveRequest::up_to(1)).await.unwrap().remove(0);
    assert_eq!(back.id, first.id);
    for receipt in [&first.receipt, &dead.receipt] {
        for q in [&f, &dlq] {
            stale_and_changes_nothing(&pool, q, receipt, "after the redrive").await;
        }
    }
    f.delete(&back.receipt).await.unwrap();
}

/// A standard queue `s` and a FIFO queue `f.fifo`, each with a message
/// to send to it.
async fn standard_and_fifo(pool: &PgPool) -> [(PgQueue, SendMessage); 2] {
    [
        (
            queue(pool, "s", QueueAttributes::default()).await,
            SendMessage::new("m"),
        ),
        (
            queue(pool, "f.fifo", QueueAttributes::fifo()).await,
            SendMessage::new("m").group("g"),
        ),
    ]
}

/// A purge ends every delivery, and a message sent again (the same body,
/// the same group) is another message: the purged delivery's receipt acts
/// on neither.
#[tokio::test]
async fn a_receipt_from_before_a_purge_acts_on_no_message_sent_after_it() {
    let pool = pool().await;
    for (q, message) in standard_and_fifo(&pool).await {
        q.send(message.clone()).await.unwrap();
        let purged = q.receive(ReceiveRequest::up_to(1)).await.unwrap().remove(0);
        assert_eq!(q.purge().await.unwrap(), 1);
        q.send(message.clone()).await.unwrap();
        stale_and_changes_nothing(&pool, &q, &purged.receipt, "after a purge and a send").await;
        let again = q.receive(ReceiveRequest::up_to(1)).await.unwrap().remove(0);
        assert_ne!(again.id, purged.id);
        stale_and_changes_nothing(&pool, &q, &purged.receipt, "after the new one's delivery").await;
        q.delete(&again.receipt).await.unwrap();
    }
}

/// A queue deleted and created again under its name is another queue: a
/// receipt of the old one, presented through a handle of either, acts on
/// none of the new one's messages.
#[tokio::test]
async fn a_receipt_of_a_deleted_queue_acts_on_nothing_of_one_created_under_its_name() {
    let pool = pool().await;
    let old = queue(&pool, "s", QueueAttributes::default()).await;
    old.send(SendMessage::new("m")).await.unwrap();
    let gone = old
        .receive(ReceiveRequest::up_to(1))
        .await
        .unwrap()
        .remove(0);
    sqlx::query("DELETE FROM pgonce.queue WHERE name = 's'")
        .execute(&pool)
        .await
        .unwrap();
    let new = queue(&pool, "s", QueueAttributes::default()).await;
    new.send(SendMessage::new("m")).await.unwrap();
    let current = new
        .receive(ReceiveRequest::up_to(1))
        .await
        .unwrap()
        .remove(0);
    for q in [&old, &new] {
        stale_and_changes_nothing(&pool, q, &gone.receipt, "after the queue was made again").await;
    }
    new.delete(&current.receipt).await.unwrap();
}

/// After a redelivery, the earlier delivery's receipt hands nothing back,
/// with a delay or without, and deletes nothing, one at a time or in a
/// batch beside the current receipt (which deletes).
#[tokio::test]
async fn a_receipt_from_before_a_redelivery_hands_back_and_deletes_nothing() {
    let pool = pool().await;
    for (q, message) in standard_and_fifo(&pool).await {
        q.send(message).await.unwrap();
        let first = q
            .receive(ReceiveRequest::up_to(1).visibility(Duration::from_millis(1)))
            .await
            .unwrap()
            .remove(0);
        let second = q
            .receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(10)))
            .await
            .unwrap()
            .remove(0);
        assert_eq!(second.id, first.id);
        stale_and_changes_nothing(&pool, &q, &first.receipt, "after a redelivery").await;
        let both = [first.receipt.clone(), second.receipt.clone()];
        assert_eq!(
            q.delete_batch(&both).await.unwrap(),
            std::slice::from_ref(&first.receipt)
        );
        assert_eq!(q.stats().await.unwrap().in_flight, 0);
    }
}

/// A message's `sent_at` set by hand to PostgreSQL's `infinity` (sqlx's
/// decoding panics on it) is delivered with the end of 9999 as its send
/// time, the nearest end of what pgonce reads back, instead of panicking
/// every receive that reaches it.
#[tokio::test]
async fn a_send_time_set_to_infinity_by_hand_is_delivered_not_a_panic() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let sent = q.send(SendMessage::new("parked")).await.unwrap();
    sqlx::query("UPDATE pgonce.queue_message SET sent_at = 'infinity'")
        .execute(&pool)
        .await
        .unwrap();
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(bodies(&got), ["parked"]);
    assert_eq!(got[0].id, sent.id);
    let latest = time::OffsetDateTime::new_utc(
        time::Date::from_calendar_date(9999, time::Month::December, 31).unwrap(),
        time::Time::from_hms_micro(23, 59, 59, 999_999).unwrap(),
    );
    assert_eq!(got[0].sent_at, std::time::SystemTime::from(latest));
}

/// A queue's figures over messages whose `sent_at` was set by hand to
/// `infinity` and `-infinity`: the oldest age reads from the nearest end
/// of what pgonce reads back (4714 BC), as a receive reads the send time,
/// and one sent at the far end of time is aged zero; the counts are as for
/// any message. `stats` used to fail with the server's "cannot subtract
/// infinite timestamps", an untyped database error.
#[tokio::test]
async fn stats_over_send_times_set_to_infinity_by_hand_read_the_ends_of_the_range() {
    let pool = pool().await;
    let q = queue(&pool, "q", QueueAttributes::default()).await;
    let later = q.send(SendMessage::new("later")).await.unwrap();
    sqlx::query("UPDATE pgonce.queue_message SET sent_at = 'infinity'")
        .execute(&pool)
        .await
        .unwrap();
    let stats = q.stats().await.unwrap();
    assert_eq!((stats.depth, stats.oldest_age), (1, Some(Duration::ZERO)));

    q.send(SendMessage::new("earlier")).await.unwrap();
    sqlx::query("UPDATE pgonce.queue_message SET sent_at = '-infinity' WHERE id <> $1")
        .bind(later.id.parse::<i64>().unwrap())
        .execute(&pool)
        .await
        .unwrap();
    let stats = q.stats().await.unwrap();
    assert_eq!(stats.depth, 2);
    let age = stats.oldest_age.expect("an age");
    // From 4714-11-24 BC to now: more than 6,700 years, fewer than 7,000.
    let year = Duration::from_secs(365 * 24 * 3600);
    assert!(age > year * 6700 && age < year * 7000, "{age:?}");
}

/// A message whose `visible_at` was set by hand to `infinity` (never
/// visible) is passed over: a receive that finds nothing else returns
/// none, at once or at the end of its wait, and the message stays. The
/// receive's look for the next visible time used to subtract it from
/// `now()`, and every receive of the queue that delivered nothing failed
/// with the server's "cannot subtract infinite timestamps".
#[tokio::test]
async fn a_visible_time_set_to_infinity_by_hand_is_passed_over_not_an_error() {
    let pool = pool().await;
    let q = PgQueue::create(&pool, "q", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    q.send(SendMessage::new("never")).await.unwrap();
    sqlx::query("UPDATE pgonce.queue_message SET visible_at = 'infinity'")
        .execute(&pool)
        .await
        .unwrap();
    assert!(
        q.receive(ReceiveRequest::up_to(10))
            .await
            .unwrap()
            .is_empty()
    );
    let waited = ReceiveRequest::up_to(10).wait(Duration::from_millis(200));
    assert!(q.receive(waited).await.unwrap().is_empty());
    let stats = q.stats().await.unwrap();
    assert_eq!((stats.depth, stats.delayed), (0, 1));
}

/// A receive of a queue deleted by hand after its handle was opened is
/// [`Error::QueueNotFound`], as a send or `stats` is, whether it waits or
/// not: a long poll parked on it when it was deleted says so at its next
/// look (here woken by a notification sent by hand). It used to return no
/// messages, as from an empty queue, for as long as it was asked.
#[tokio::test]
async fn a_receive_of_a_queue_deleted_by_hand_is_queue_not_found() {
    let pool = pool().await;
    let q = PgQueue::create(&pool, "q", QueueAttributes::default(), no_poll())
        .await
        .unwrap();
    let receiver = {
        let q = q.clone();
        tokio::spawn(async move { q.receive(ReceiveRequest::up_to(10).wait(LONG_POLL)).await })
    };
    wait_until("a receive parked", || async { q.parked_receivers() > 0 }).await;
    sqlx::query("DELETE FROM pgonce.queue WHERE name = 'q'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_notify('pgonce_queue', 'q')")
        .execute(&pool)
        .await
        .unwrap();
    let parked = tokio::time::timeout(Duration::from_secs(60), receiver)
        .await
        .expect("looked when woken, found no queue, and parked again as on an empty queue")
        .unwrap();
    assert!(
        matches!(&parked, Err(Error::QueueNotFound { name }) if name == "q"),
        "{parked:?}"
    );
    for wait in [Duration::ZERO, Duration::from_millis(200)] {
        let got = q.receive(ReceiveRequest::up_to(1).wait(wait)).await;
        assert!(
            matches!(&got, Err(Error::QueueNotFound { name }) if name == "q"),
            "{got:?}"
        );
    }
}

/// The default attributes of a FIFO queue, or of a standard one.
fn of_kind(fifo: bool) -> QueueAttributes {
    if fifo {
        QueueAttributes::fifo()
    } else {
        QueueAttributes::default()
    }
}

/// A message for a queue of that kind: grouped in a FIFO queue.
fn message_of_kind(fifo: bool, body: &str) -> SendMessage {
    let m = SendMessage::new(body);
    if fifo { m.group("g") } else { m }
}

/// Asserts that `what` was [`Error::QueueNotFound`] naming queue q.
fn assert_q_not_found<T: std::fmt::Debug>(what: &str, got: pgonce::Result<T>) {
    assert!(
        matches!(&got, Err(Error::QueueNotFound { name }) if name == "q"),
        "{what}: {got:?}"
    );
}

/// The queue of each message in the database.
async fn queues_of_messages(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT queue FROM pgonce.queue_message")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A handle keeps its queue's kind: once the queue is deleted by hand and
/// one of the other kind is created under its name, the handle's sends and
/// receives are [`Error::QueueNotFound`] (its queue is gone) and write
/// nothing. A standard handle used to send group-less messages into the
/// FIFO queue, which its receives never hand out (they walk grouped
/// messages only), and to receive a FIFO group's messages several at a
/// time, out of their order; a FIFO handle on the standard queue sent
/// grouped messages there and received nothing, as from an empty queue.
#[tokio::test]
async fn a_handle_of_a_queue_recreated_as_the_other_kind_is_queue_not_found() {
    let pool = pool().await;
    let message = message_of_kind;
    for fifo in [false, true] {
        let old = PgQueue::create(&pool, "q", of_kind(fifo), no_poll())
            .await
            .unwrap();
        let delete = "DELETE FROM pgonce.queue WHERE name = 'q'";
        sqlx::query(delete).execute(&pool).await.unwrap();
        let new = PgQueue::create(&pool, "q", of_kind(!fifo), no_poll())
            .await
            .unwrap();
        let both = vec![message(!fifo, "a"), message(!fifo, "b")];
        new.send_batch(both).await.unwrap();

        assert_q_not_found("receive", old.receive(ReceiveRequest::up_to(10)).await);
        assert_q_not_found("send", old.send(message(fifo, "c")).await);
        let batch = vec![message(fifo, "d"), message(fifo, "e")];
        assert_q_not_found("send_batch", old.send_batch(batch).await);
        if fifo {
            let mut batch = vec![message(fifo, "f"), message(fifo, "g")];
            batch[0].dedup_id = Some("f".into());
            assert_q_not_found("send_batch, a dedup id", old.send_batch(batch).await);
        }
        let bodies: Vec<String> =
            sqlx::query_scalar("SELECT body FROM pgonce.queue_message ORDER BY id")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(bodies, ["a", "b"], "a FIFO handle: {fifo}: it sent nothing");
        sqlx::query(delete).execute(&pool).await.unwrap();
    }
}

/// A handle whose queue was deleted by hand, or deleted and created again
/// as the other kind, is [`Error::QueueNotFound`] to `purge`, `stats`,
/// `delete`, `delete_batch` and `change_visibility` too, as to a send or a
/// receive, and touches nothing of the queue that stands under the name.
/// A purge deleted the new queue's messages (or said it purged 0 of a
/// queue that is gone), `stats` reported the new queue's figures, and the
/// deliveries' calls said their receipts were stale, or acted on the new
/// queue's message by one of its receipts.
#[tokio::test]
async fn lifecycle_calls_of_a_handle_whose_queue_is_gone_are_queue_not_found() {
    let pool = pool().await;
    let message = message_of_kind;
    let delete = "DELETE FROM pgonce.queue WHERE name = 'q'";
    for fifo in [false, true] {
        for recreated in [false, true] {
            let case = format!("a FIFO handle: {fifo}, recreated as the other kind: {recreated}");
            let old = PgQueue::create(&pool, "q", of_kind(fifo), no_poll())
                .await
                .unwrap();
            old.send(message(fifo, "old")).await.unwrap();
            let delivery = old
                .receive(ReceiveRequest::up_to(1))
                .await
                .unwrap()
                .remove(0);
            sqlx::query(delete).execute(&pool).await.unwrap();
            let mut receipts = vec![delivery.receipt];
            if recreated {
                let new = PgQueue::create(&pool, "q", of_kind(!fifo), no_poll())
                    .await
                    .unwrap();
                new.send_batch(vec![message(!fifo, "a"), message(!fifo, "b")])
                    .await
                    .unwrap();
                // The new queue's receipt, "q:<id>:<generation>" as the
                // old queue's were.
                let new_delivery = new
                    .receive(ReceiveRequest::up_to(1))
                    .await
                    .unwrap()
                    .remove(0);
                receipts.push(new_delivery.receipt);
            }
            for receipt in &receipts {
                assert_q_not_found(&format!("{case}: delete"), old.delete(receipt).await);
                let hidden = old.change_visibility(receipt, Duration::ZERO).await;
                assert_q_not_found(&format!("{case}: change_visibility"), hidden);
            }
            assert_q_not_found(
                &format!("{case}: delete_batch"),
                old.delete_batch(&receipts).await,
            );
            assert_q_not_found(&format!("{case}: stats"), old.stats().await);
            assert_q_not_found(&format!("{case}: purge"), old.purge().await);
            let left: Vec<String> =
                sqlx::query_scalar("SELECT body FROM pgonce.queue_message ORDER BY id")
                    .fetch_all(&pool)
                    .await
                    .unwrap();
            let expected: &[&str] = if recreated { &["a", "b"] } else { &[] };
            assert_eq!(left, expected, "{case}: nothing of the new queue touched");
            if recreated {
                let in_flight: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pgonce.queue_message WHERE visible_at > now()",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                assert_eq!(in_flight, 1, "{case}: the new delivery not handed back");
            }
            sqlx::query(delete).execute(&pool).await.unwrap();
        }
    }
}

/// A send, one message or a batch, to queue q of a fresh database while
/// another session runs `by_hand` on q's row in a transaction: the send is
/// seen waiting for that session, which then commits. Returns the send's
/// outcome and how many messages the database holds after it.
async fn send_racing(by_hand: &'static str, one: bool) -> (pgonce::Result<()>, i64) {
    let (db, setup) = database_with_queue("q", QueueAttributes::default()).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let hand = race.session("H").await.unwrap();
    let sender = race.session("S").await.unwrap();
    let q = PgQueue::open(sender.pool(), "q", no_poll()).await.unwrap();
    let mut tx = hand.pool().begin().await.unwrap();
    race.try_step(&hand, by_hand, sqlx::raw_sql(by_hand).execute(&mut *tx))
        .await
        .unwrap();
    let sending = race
        .step_blocks(&sender, "send to q", async move {
            if one {
                q.send(SendMessage::new("m")).await.map(|_| ())
            } else {
                let batch = vec![SendMessage::new("a"), SendMessage::new("b")];
                q.send_batch(batch).await.map(|_| ())
            }
        })
        .await
        .unwrap();
    assert_eq!(sending.blocked_by(), ["H"]);
    race.try_step(&hand, "commit", tx.commit()).await.unwrap();
    let sent = sending.resume().await.unwrap();
    let messages: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.queue_message")
        .fetch_one(&setup)
        .await
        .unwrap();
    (sent, messages)
}

/// A send racing its queue's deletion by hand (the delete, uncommitted,
/// holds the queue's row; the send waits for it, then the delete commits)
/// is [`Error::QueueNotFound`], as a send after it is, and sends nothing,
/// whether one message or a batch. It failed with the foreign key's
/// violation, an untyped database error.
#[tokio::test]
async fn a_send_racing_its_queues_deletion_by_hand_is_queue_not_found() {
    for one in [true, false] {
        let (sent, messages) = send_racing("DELETE FROM pgonce.queue WHERE name = 'q'", one).await;
        assert!(
            matches!(&sent, Err(Error::QueueNotFound { name }) if name == "q"),
            "one message: {one}: {sent:?}"
        );
        assert_eq!(messages, 0);
    }
}

/// A send racing its queue's replacement by hand, deleted and created
/// again as its own kind in one transaction (uncommitted, holding the
/// old row; the send waits for it, then it commits), sends to the queue
/// that stands, one message or a batch: the queue was never missing to
/// anyone, and a send after it goes there. It said
/// [`Error::QueueNotFound`]: its insert's foreign key check found the row
/// it waited for deleted.
#[tokio::test]
async fn a_send_racing_its_queues_replacement_by_hand_sends_to_the_new_queue() {
    let replace = "DELETE FROM pgonce.queue WHERE name = 'q'; \
                   INSERT INTO pgonce.queue (name, fifo, visibility_timeout_ms, retention_ms, \
                                             delay_ms, dedup_window_ms) \
                   VALUES ('q', false, 30000, 345600000, 0, 300000)";
    for one in [true, false] {
        let (sent, messages) = send_racing(replace, one).await;
        assert!(sent.is_ok(), "one message: {one}: {sent:?}");
        assert_eq!(messages, if one { 1 } else { 2 });
    }
}

/// A redrive sends each dead letter back to the queue it came from, and to
/// no other: when that queue was deleted by hand since, the redrive is
/// [`Error::QueueNotFound`] naming it, and moves nothing (it failed with
/// the foreign key's violation, an untyped database error); so it is when
/// a queue of the other kind was created under the name (a standard
/// queue's dead letter, group-less, went into the FIFO queue, whose
/// receives never hand it out). Created again as its own kind, the queue
/// takes its dead letters back.
#[tokio::test]
async fn a_redrive_to_a_source_deleted_or_recreated_by_hand_is_queue_not_found() {
    let pool = pool().await;
    let dlq = queue(&pool, "jobs-dlq", QueueAttributes::default()).await;
    let at_once = QueueAttributes::default().visibility_timeout(Duration::ZERO);
    let q = queue(&pool, "jobs", at_once.clone().dead_letter("jobs-dlq", 1)).await;
    q.send(SendMessage::new("m")).await.unwrap();
    for _ in 0..2 {
        q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    }
    let in_queue = || queues_of_messages(&pool);
    assert_eq!(in_queue().await, ["jobs-dlq"], "dead-lettered");
    let delete = "DELETE FROM pgonce.queue WHERE name = 'jobs'";
    sqlx::query(delete).execute(&pool).await.unwrap();
    for recreated_as in [None, Some(QueueAttributes::fifo())] {
        if let Some(attributes) = recreated_as.clone() {
            sqlx::query(delete).execute(&pool).await.unwrap();
            PgQueue::create(&pool, "jobs", attributes, no_poll())
                .await
                .unwrap();
        }
        let got = dlq.redrive().await;
        assert!(
            matches!(&got, Err(Error::QueueNotFound { name }) if name == "jobs"),
            "recreated as {recreated_as:?}: {got:?}"
        );
        assert_eq!(in_queue().await, ["jobs-dlq"], "{recreated_as:?}");
    }
    sqlx::query(delete).execute(&pool).await.unwrap();
    queue(&pool, "jobs", at_once).await;
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    assert_eq!(in_queue().await, ["jobs"]);
}

/// A redrive of a dead-letter queue shared by two sources, one of them
/// deleted by hand, moves the other's letters back and is
/// [`Error::QueueNotFound`] naming the one that is gone, whose letters
/// stay; a batch's worth of those ahead of the others holds nothing back.
/// It moved nothing: every later redrive failed on the first letter of
/// the deleted queue, and the other queue's letters were stuck behind it.
#[tokio::test]
async fn a_redrive_moves_the_letters_of_the_sources_that_stand_past_one_deleted() {
    let pool = pool().await;
    let dlq = queue(&pool, "d", QueueAttributes::default()).await;
    let at_once = QueueAttributes::default().visibility_timeout(Duration::ZERO);
    queue(&pool, "gone", at_once.clone().dead_letter("d", 1)).await;
    let stands = queue(&pool, "stands", at_once.dead_letter("d", 1)).await;
    // More letters of the queue to be deleted than a redrive's batch,
    // ahead of the other queue's.
    sqlx::query(
        "INSERT INTO pgonce.queue_message (queue, body, visible_at, dead_lettered_from) \
         SELECT 'd', 'orphan', now(), 'gone' FROM generate_series(1, $1)",
    )
    .bind(pgonce::queue::MAX_BATCH as i32 + 1)
    .execute(&pool)
    .await
    .unwrap();
    stands.send(SendMessage::new("m")).await.unwrap();
    for _ in 0..2 {
        stands.receive(ReceiveRequest::up_to(1)).await.unwrap();
    }
    sqlx::query("DELETE FROM pgonce.queue WHERE name = 'gone'")
        .execute(&pool)
        .await
        .unwrap();
    let in_queues = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT queue || ' ' || body FROM pgonce.queue_message \
             GROUP BY queue, body ORDER BY queue, body",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    assert_eq!(in_queues().await, ["d m", "d orphan"]);
    for round in 0..2 {
        let got = dlq.redrive().await;
        assert!(
            matches!(&got, Err(Error::QueueNotFound { name }) if name == "gone"),
            "round {round}: {got:?}"
        );
        assert_eq!(in_queues().await, ["d orphan", "stands m"], "round {round}");
    }
    assert_eq!(
        stands.receive(ReceiveRequest::up_to(1)).await.unwrap()[0].body,
        "m"
    );
}

/// A redrive by a handle whose dead-letter queue was deleted by hand and
/// created again as the other kind is [`Error::QueueNotFound`] naming that
/// queue, the handle's own, and moves nothing. It used to name the source
/// of the new queue's dead letters, which stood there of its kind: the
/// handle judged the sources by its own old kind, as if they, not its
/// queue, had been recreated.
#[tokio::test]
async fn a_redrive_by_a_handle_of_a_queue_recreated_as_the_other_kind_names_its_queue() {
    let pool = pool().await;
    let attributes = |fifo| of_kind(fifo).visibility_timeout(Duration::ZERO);
    let in_queue = || queues_of_messages(&pool);
    for fifo in [false, true] {
        let old = PgQueue::create(&pool, "d", attributes(fifo), no_poll())
            .await
            .unwrap();
        sqlx::query("DELETE FROM pgonce.queue WHERE name = 'd'")
            .execute(&pool)
            .await
            .unwrap();
        PgQueue::create(&pool, "d", attributes(!fifo), no_poll())
            .await
            .unwrap();
        let source = PgQueue::create(&pool, "s", attributes(!fifo).dead_letter("d", 1), no_poll())
            .await
            .unwrap();
        let message = SendMessage::new("m");
        source
            .send(if fifo { message } else { message.group("g") })
            .await
            .unwrap();
        for _ in 0..2 {
            source.receive(ReceiveRequest::up_to(1)).await.unwrap();
        }
        assert_eq!(in_queue().await, ["d"], "dead-lettered");
        let got = old.redrive().await;
        assert!(
            matches!(&got, Err(Error::QueueNotFound { name }) if name == "d"),
            "a FIFO handle: {fifo}: {got:?}"
        );
        assert_eq!(
            in_queue().await,
            ["d"],
            "a FIFO handle: {fifo}: nothing moved"
        );
        sqlx::query("DELETE FROM pgonce.queue WHERE name IN ('s', 'd')")
            .execute(&pool)
            .await
            .unwrap();
    }
}

/// A redrive by a handle whose queue was deleted by hand (its dead
/// letters with it), or deleted and created again as the other kind with
/// nothing in it, is [`Error::QueueNotFound`], as every other call of the
/// handle says then. It was `Ok(0)`: with no letter picked, the redrive
/// never looked at the queue.
#[tokio::test]
async fn an_empty_redrive_of_a_queue_deleted_or_recreated_by_hand_is_queue_not_found() {
    let pool = pool().await;
    for fifo in [false, true] {
        let old = PgQueue::create(&pool, "d", of_kind(fifo), no_poll())
            .await
            .unwrap();
        assert_eq!(old.redrive().await.unwrap(), 0, "nothing to move");
        let delete = "DELETE FROM pgonce.queue WHERE name = 'd'";
        sqlx::query(delete).execute(&pool).await.unwrap();
        let got = old.redrive().await;
        assert!(
            matches!(&got, Err(Error::QueueNotFound { name }) if name == "d"),
            "deleted, a FIFO handle: {fifo}: {got:?}"
        );
        PgQueue::create(&pool, "d", of_kind(!fifo), no_poll())
            .await
            .unwrap();
        let got = old.redrive().await;
        assert!(
            matches!(&got, Err(Error::QueueNotFound { name }) if name == "d"),
            "recreated as the other kind, a FIFO handle: {fifo}: {got:?}"
        );
        sqlx::query(delete).execute(&pool).await.unwrap();
    }
}

/// A redrive racing its source queue's replacement by hand, deleted and
/// created again as its own kind in one transaction (uncommitted, holding
/// the old row; the redrive waits for it reading its sources, then it
/// commits), moves the dead letter back to the queue that stands: the
/// queue was never missing to anyone, and a redrive after it goes there.
/// It said [`Error::QueueNotFound`] naming the source: its read of the
/// sources skipped the row it had waited for, deleted, and its snapshot,
/// taken before, did not see the new one.
#[tokio::test]
async fn a_redrive_racing_its_sources_replacement_by_hand_moves_to_the_new_queue() {
    let (db, setup) = database_with_queue("d", QueueAttributes::default()).await;
    let at_once = QueueAttributes::default().visibility_timeout(Duration::ZERO);
    let q = PgQueue::create(&setup, "s", at_once.dead_letter("d", 1), no_poll())
        .await
        .unwrap();
    q.send(SendMessage::new("m")).await.unwrap();
    for _ in 0..2 {
        q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    }
    assert_eq!(queues_of_messages(&setup).await, ["d"], "dead-lettered");
    let race = Interleaving::new(db.options()).await.unwrap();
    let hand = race.session("H").await.unwrap();
    let redriver = race.session("R").await.unwrap();
    let dlq = PgQueue::open(redriver.pool(), "d", no_poll())
        .await
        .unwrap();
    let replace = "DELETE FROM pgonce.queue WHERE name = 's'; \
                   INSERT INTO pgonce.queue (name, fifo, visibility_timeout_ms, retention_ms, \
                                             delay_ms, dedup_window_ms) \
                   VALUES ('s', false, 30000, 345600000, 0, 300000)";
    let mut tx = hand.pool().begin().await.unwrap();
    race.try_step(&hand, replace, sqlx::raw_sql(replace).execute(&mut *tx))
        .await
        .unwrap();
    let redriving = race
        .step_blocks(&redriver, "redrive d", async move { dlq.redrive().await })
        .await
        .unwrap();
    assert_eq!(redriving.blocked_by(), ["H"]);
    race.try_step(&hand, "commit", tx.commit()).await.unwrap();
    let moved = redriving.resume().await.unwrap();
    assert!(matches!(moved, Ok(1)), "{moved:?}");
    assert_eq!(queues_of_messages(&setup).await, ["s"]);
}

/// A queue listener whose database is down (a server of the test's own,
/// stopped) keeps trying to LISTEN again, and each
/// failed try counts in `pgonce_queue_listener_failed_tries_total`; the
/// log has the first at warn with its error, then at most one warn line
/// per minute of the outage, the others at debug. Ten minutes of tokio's
/// paused clock: the bounds are read from that clock, not from how fast
/// the machine runs. (Each failed try was logged at warn, a line every
/// try for as long as the outage lasted, and counted nowhere.)
#[tokio::test]
async fn a_queue_listener_that_cannot_listen_again_logs_a_line_a_minute_and_counts_each_try() {
    let (mut cluster, pool) =
        pgonce_testkit::own_migrated_cluster(4, Duration::from_secs(1), pgonce::migrate).await;
    let q = PgQueue::create(&pool, "q", QueueAttributes::default(), slow_poll())
        .await
        .unwrap();
    let parked = {
        let q = q.clone();
        // Fails once the server is stopped: only its listener matters.
        tokio::spawn(async move {
            let _ = q
                .receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(20)))
                .await;
        })
    };
    parked_and_listening(&q, &pool).await;

    let (metric, recorder) = support::count_of("pgonce_queue_listener_failed_tries_total");
    // On this single-threaded runtime the listener's task records here too.
    let _local = metrics::set_default_local_recorder(&recorder);
    let logged = pgonce_testkit::logs::LogLines::default();
    let _logging = logged.capture();
    cluster.stop();
    const OUTAGE: Duration = Duration::from_secs(600);
    tokio::time::pause();
    tokio::time::sleep(OUTAGE).await;
    parked.abort();

    let failed = metric.load(std::sync::atomic::Ordering::SeqCst);
    // A try every half second plus the time its connect takes to give up
    // (the listener's own pool's acquire timeout, 30 s, against a stopped
    // server): about twenty; some, whatever the jumps of the clock.
    assert!(failed >= 10, "the tries went on failing: {failed}");
    let first = logged.assert_run_of_failures(
        failed,
        OUTAGE,
        "queue listener cannot listen again yet",
        "queue listener still cannot listen again",
        None,
    );
    assert!(first.error.is_some(), "with its error: {first:?}");
    let still = logged.starting(
        tracing::Level::WARN,
        "queue listener still cannot listen again",
    );
    assert!(!still.is_empty(), "a line a minute while it goes on");
    drop(q);
    drop(cluster);
}

/// A queue listener that lost its connection and then failed to LISTEN
/// again three times (each connection refused through the proxy) logs the
/// first failed try at warn, the next at debug, and once it LISTENs again
/// one info line saying after how many failed tries. (Each failed try was
/// logged at warn, and the line once it was back said nothing of them.)
#[tokio::test]
async fn a_queue_listener_listening_again_says_after_how_many_failed_tries() {
    let (db, plain) = fresh_migrated_database(4, pgonce::migrate).await;
    let mut proxy = FaultProxy::start(db.options(), NewConnections::HandOver)
        .await
        .unwrap();
    let q = listening_through(&proxy, &plain).await;
    let logged = pgonce_testkit::logs::LogLines::default();
    let _logging = logged.capture();
    let receiver = spawn_receive(&q, Duration::from_secs(20));
    proxy.next_connection().await.forward();
    parked_and_listening(&q, &plain).await;

    terminate_listener(&plain).await;
    // The old listener's own reconnect (its error ends it), then three
    // tries of new ones.
    for _ in 0..4 {
        proxy.next_connection().await.refuse();
    }
    proxy.next_connection().await.forward();
    let back = loop {
        let back = logged.starting(tracing::Level::INFO, "queue listener listening again");
        if !back.is_empty() {
            break back;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(back.len(), 1, "once: {back:?}");
    assert!(
        back[0]
            .message
            .starts_with("queue listener listening again after 3 failed tries since "),
        "{back:?}"
    );
    let first = logged.starting(
        tracing::Level::WARN,
        "queue listener cannot listen again yet",
    );
    assert_eq!(
        first.len(),
        1,
        "the first failed try alone at warn: {first:?}"
    );
    assert!(first[0].error.is_some(), "with its error: {first:?}");
    receiver.abort();
}
