//! The PostgreSQL queue against a real PostgreSQL: the backend-independent
//! conformance suite (`pgonce::queue::conformance`, also run against SQS),
//! then what only this backend offers: transactional enqueue, one-statement
//! receives under racing sessions, typed errors for bad input.

use std::time::Duration;

use pgonce::queue::conformance::*;
use pgonce::{
    Error, PgQueue, PgQueueOptions, Queue, QueueAttributes, Receipt, ReceiveRequest, SendMessage,
};
use pgonce_testkit::fresh_database;
use sqlx::PgPool;

async fn pool() -> PgPool {
    let pool = fresh_database().await.pool(20).await.unwrap();
    pgonce::migrate(&pool).await.unwrap();
    pool
}

/// Re-polls often, so waits for a visibility timeout end promptly.
fn fast_poll() -> PgQueueOptions {
    PgQueueOptions {
        poll_interval: Duration::from_millis(100),
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
    let (left,): (i64,) = sqlx::query_as("SELECT count(*) FROM pgonce.queue_message")
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
    let (now_in, history) = q.history(&sent.id).await.unwrap().unwrap();
    assert_eq!(now_in, "jobs-dlq");
    assert_eq!(history[0]["event"], "dead_lettered");
    assert_eq!(history[0]["from"], "jobs");
    assert_eq!(history[0]["receive_count"], 2);
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    let (now_in, history) = q.history(&sent.id).await.unwrap().unwrap();
    assert_eq!(now_in, "jobs");
    assert_eq!(history[1]["event"], "redriven");
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
    // No re-polling on its own within the test's wait: only NOTIFY can wake it.
    let options = PgQueueOptions {
        poll_interval: Duration::from_secs(60),
        ..PgQueueOptions::default()
    };
    let q = PgQueue::create(&pool, "q", QueueAttributes::default(), options)
        .await
        .unwrap();
    let parked = async {
        while q.parked_receivers() == 0 {
            tokio::task::yield_now().await;
        }
    };
    conformance_long_poll_wakes_on_send(&q, parked).await;
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
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
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

    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
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
        Err(Error::Invalid { .. })
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
        let mut tx = a
            .pool()
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
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
    let bodies: Vec<_> = got.iter().map(|m| m.body.as_str()).collect();
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
    let mut bodies: Vec<_> = first.iter().map(|m| m.body.as_str()).collect();
    bodies.sort();
    assert_eq!(bodies, ["a", "x"]);
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
    assert_eq!(
        next.iter().map(|m| m.body.as_str()).collect::<Vec<_>>(),
        ["b"]
    );
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
    let db = fresh_database().await;
    let pool = db.pool(2).await.unwrap();
    pgonce::migrate(&pool).await.unwrap();
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

/// `listen: false` opens no LISTEN connection (long polls only re-poll);
/// `listen_url` puts it on that URL, not on the pool (behind a
/// transaction-mode pooler, the pool's connections cannot LISTEN).
#[tokio::test]
async fn listen_can_be_turned_off_or_sent_to_a_direct_url() {
    use sqlx::ConnectOptions;
    let db = fresh_database().await;
    let pool = db.pool(4).await.unwrap();
    pgonce::migrate(&pool).await.unwrap();
    let poll = ReceiveRequest::up_to(1).wait(Duration::from_millis(30));

    let off = PgQueueOptions {
        listen: false,
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

    let mut url = db.options().to_url_lossy();
    url.query_pairs_mut()
        .append_pair("application_name", "pgonce_direct_listener");
    let url = url.to_string();
    let direct = PgQueueOptions {
        listen_url: Some(url),
        ..PgQueueOptions::default()
    };
    let q = PgQueue::create(&pool, "direct", QueueAttributes::default(), direct)
        .await
        .unwrap();
    assert!(q.receive(poll).await.unwrap().is_empty());
    assert_eq!(listeners(&pool).await, ["pgonce_direct_listener"]);
}
