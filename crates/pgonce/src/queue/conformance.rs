//! The conformance suite every [`Queue`] backend must pass, and with it the
//! worker runtime on that backend. Each `conformance_*` function states the
//! guarantee it checks and the queue attributes it needs; a backend's test
//! file creates such queues and calls it. The functions panic on a
//! violation (they are test code) and leave the queues empty-ish only where
//! said.
//!
//! Timing: visibility timeouts are whole seconds (SQS's granularity), and
//! the only waits are for a timeout to run out, never to "let a race
//! happen".

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore};

use super::{
    AckPolicy, Handler, HandlerError, MAX_BATCH, MAX_BODY_BYTES, MAX_VISIBILITY, MAX_WAIT, Queue,
    Receipt, ReceiveRequest, Received, SendMessage, Worker, WorkerConfig,
};
use crate::error::Error;

/// Receives (long polling, up to `limit`) until `n` messages arrived.
async fn receive_n(q: &impl Queue, n: usize, limit: Duration) -> Vec<Received> {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "only {} of {n} messages within {limit:?}",
            got.len()
        );
        let wait = left.min(Duration::from_secs(2));
        got.extend(
            q.receive(ReceiveRequest::up_to(10.min(n - got.len())).wait(wait))
                .await
                .expect("receive"),
        );
    }
    got
}

/// What a backend cannot do, stated by its test file; each `_with` function
/// skips exactly the assertions a `false` field names. [`Caveats::NONE`]
/// (everything holds) is what the functions without `_with` use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caveats {
    /// The server refuses an earlier delivery's receipt with
    /// [`Error::StaleReceipt`] (SQS and moto accept it).
    pub fences_receipts: bool,
    /// A deduplicated send reports `duplicate` and the original message's id
    /// (SQS reports neither reliably; moto returns a fresh id).
    pub reports_duplicates: bool,
    /// A deduplication id is still remembered after its message was deleted
    /// (moto forgets it; SQS remembers it for the window).
    pub dedup_survives_delete: bool,
    /// Concurrent receives of a FIFO queue respect the group lock (moto's
    /// does not: two ReceiveMessage requests racing can each take a message
    /// of one group). When false, the many-consumers test lets one consumer
    /// receive at a time; handling and deleting stay concurrent.
    pub receives_atomic: bool,
}

impl Caveats {
    /// Every guarantee holds (the PostgreSQL queue).
    pub const NONE: Caveats = Caveats {
        fences_receipts: true,
        reports_duplicates: true,
        dedup_survives_delete: true,
        receives_atomic: true,
    };
}

/// A delivery a [`Recording`] handler started on.
#[derive(Debug, Clone)]
struct Start {
    id: String,
    receive_count: u32,
}

/// A handler that counts starts and can be held.
struct Recording {
    seen: Mutex<Vec<Start>>,
    started: AtomicUsize,
    started_notify: Notify,
}

impl Recording {
    fn new() -> Recording {
        Recording {
            seen: Mutex::new(Vec::new()),
            started: AtomicUsize::new(0),
            started_notify: Notify::new(),
        }
    }

    fn start(&self, m: &Received) {
        self.seen.lock().unwrap().push(Start {
            id: m.id.clone(),
            receive_count: m.receive_count,
        });
        self.started.fetch_add(1, Ordering::SeqCst);
        self.started_notify.notify_waiters();
    }

    async fn wait_started(&self, n: usize) {
        loop {
            let notified = self.started_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.started.load(Ordering::SeqCst) >= n {
                return;
            }
            notified.await;
        }
    }
}

/// Never finishes: a consumer that dies in the middle of its handler.
struct Hangs(Arc<Recording>);

impl Handler for Hangs {
    async fn handle(&self, m: &Received) -> Result<(), HandlerError> {
        self.0.start(m);
        std::future::pending().await
    }
}

/// Succeeds at once.
struct Succeeds(Arc<Recording>);

impl Handler for Succeeds {
    async fn handle(&self, m: &Received) -> Result<(), HandlerError> {
        self.0.start(m);
        Ok(())
    }
}

/// At least once: a consumer that dies mid-handler (its task is dropped,
/// nothing acked) loses nothing; every message is redelivered after the
/// visibility timeout and handled by the next worker, then gone.
///
/// Needs: an empty standard queue with a 1 s visibility timeout.
pub async fn conformance_at_least_once_when_consumer_dies<Q: Queue + Clone + 'static>(q: &Q) {
    let n = 6;
    let batch: Vec<_> = (0..n)
        .map(|i| SendMessage::new(format!("job-{i}")))
        .collect();
    q.send_batch(batch).await.expect("send_batch");
    let config = WorkerConfig {
        concurrency: n,
        batch: n,
        wait: Duration::from_secs(1),
        heartbeat_interval: None,
        ..WorkerConfig::default()
    };

    let dying = Arc::new(Recording::new());
    let worker = Worker::new(q.clone(), Hangs(dying.clone()), config.clone()).unwrap();
    let crashed = tokio::spawn(async move { worker.run(std::future::pending()).await });
    tokio::time::timeout(Duration::from_secs(20), dying.wait_started(n))
        .await
        .expect("the first worker receives every message");
    crashed.abort(); // the process dies: no ack, no heartbeat, no cleanup
    let _ = crashed.await;

    let next = Arc::new(Recording::new());
    let worker = Worker::new(q.clone(), Succeeds(next.clone()), config).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = worker.run(async {
        let _ = stop_rx.await;
    });
    let drive = async {
        tokio::time::timeout(Duration::from_secs(20), next.wait_started(n))
            .await
            .expect("every message is redelivered after the visibility timeout");
        let _ = stop_tx.send(());
    };
    let (counters, ()) = tokio::join!(run, drive);
    let seen = next.seen.lock().unwrap().clone();
    let ids: BTreeSet<_> = seen.iter().map(|s| s.id.clone()).collect();
    let first_ids: BTreeSet<_> = dying
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.id.clone())
        .collect();
    assert_eq!(ids, first_ids, "the same messages, none lost");
    assert!(seen.iter().all(|s| s.receive_count >= 2), "{seen:?}");
    assert!(counters.redelivered >= n as u64);
    assert_eq!(counters.deleted, counters.succeeded);
    let left = q
        .receive(ReceiveRequest::up_to(10).wait(Duration::from_secs(2)))
        .await
        .unwrap();
    assert!(left.is_empty(), "acked messages are gone: {left:?}");
}

/// FIFO: with many consumers at once, each group's messages are handled in
/// send order, never two of one group in flight, and every message once
/// (consumers ack everything they handle).
///
/// Needs: an empty FIFO queue with a visibility timeout of 30 s or more.
pub async fn conformance_fifo_order_with_many_consumers<Q: Queue + Clone + 'static>(q: &Q) {
    conformance_fifo_order_with_many_consumers_with(q, Caveats::NONE).await
}

/// [`conformance_fifo_order_with_many_consumers`], skipping what `caveats`
/// names.
pub async fn conformance_fifo_order_with_many_consumers_with<Q: Queue + Clone + 'static>(
    q: &Q,
    caveats: Caveats,
) {
    let receive_lock = Arc::new(tokio::sync::Mutex::new(()));
    let (groups, per_group, consumers) = (8usize, 12usize, 6usize);
    let mut all = Vec::new();
    for seq in 0..per_group {
        for g in 0..groups {
            all.push(SendMessage::new(format!("{g}:{seq}")).group(format!("g{g}")));
        }
    }
    for chunk in all.chunks(10) {
        q.send_batch(chunk.to_vec()).await.expect("send_batch");
    }
    let total = groups * per_group;
    let in_flight: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let log: Arc<Mutex<BTreeMap<String, Vec<usize>>>> = Arc::default();
    let done = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..consumers {
        let (q, in_flight, log, done) = (q.clone(), in_flight.clone(), log.clone(), done.clone());
        let receive_lock = receive_lock.clone();
        tasks.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while done.load(Ordering::SeqCst) < total && Instant::now() < deadline {
                let serial = match caveats.receives_atomic {
                    true => None,
                    false => Some(receive_lock.lock().await),
                };
                let got = q
                    .receive(ReceiveRequest::up_to(5).wait(Duration::from_millis(500)))
                    .await
                    .expect("receive");
                for m in &got {
                    let group = m.group_id.clone().expect("FIFO messages have a group");
                    assert!(
                        in_flight.lock().unwrap().insert(group.clone()),
                        "two messages of {group} in flight at once"
                    );
                }
                drop(serial);
                for m in got {
                    let group = m.group_id.clone().unwrap();
                    let seq: usize = m.body.split(':').nth(1).unwrap().parse().unwrap();
                    log.lock()
                        .unwrap()
                        .entry(group.clone())
                        .or_default()
                        .push(seq);
                    tokio::task::yield_now().await;
                    in_flight.lock().unwrap().remove(&group);
                    q.delete(&m.receipt).await.expect("delete");
                    done.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("consumer panicked");
    }
    let log = log.lock().unwrap();
    assert_eq!(log.len(), groups);
    for (group, seqs) in log.iter() {
        assert_eq!(
            seqs,
            &(0..per_group).collect::<Vec<_>>(),
            "group {group} out of order or incomplete"
        );
    }
}

/// FIFO: a group whose head is in flight holds back only itself; the other
/// groups' messages are received meanwhile.
///
/// Needs: an empty FIFO queue with a visibility timeout of 30 s or more.
pub async fn conformance_fifo_groups_are_independent(q: &impl Queue) {
    q.send_batch(vec![
        SendMessage::new("slow-1").group("slow"),
        SendMessage::new("slow-2").group("slow"),
        SendMessage::new("fast-1").group("fast"),
        SendMessage::new("fast-2").group("fast"),
    ])
    .await
    .unwrap();
    let first = receive_n(q, 2, Duration::from_secs(10)).await;
    let heads: BTreeSet<_> = first.iter().map(|m| m.body.as_str()).collect();
    assert_eq!(
        heads,
        BTreeSet::from(["slow-1", "fast-1"]),
        "one head per group"
    );
    let fast = first.iter().find(|m| m.body == "fast-1").unwrap();
    q.delete(&fast.receipt).await.unwrap();
    let next = receive_n(q, 1, Duration::from_secs(10)).await;
    assert_eq!(
        next[0].body, "fast-2",
        "the fast group moves on while slow-1 is in flight"
    );
    let more = q
        .receive(ReceiveRequest::up_to(10).wait(Duration::from_secs(1)))
        .await
        .unwrap();
    assert!(more.is_empty(), "slow-2 waits behind slow-1: {more:?}");
}

/// Fenced receipts: after a redelivery, the earlier receipt deletes and
/// extends nothing and says so ([`Error::StaleReceipt`]); the current one
/// works.
///
/// Requests outside the limits every backend shares are the same typed
/// error on each, with nothing sent, received or deleted: an empty batch or
/// one past [`MAX_BATCH`], a receive of no message or past `MAX_BATCH`, a
/// visibility past [`MAX_VISIBILITY`], a wait past [`MAX_WAIT`] (whose
/// deadline used to overflow and panic). A message past
/// [`MAX_BODY_BYTES`] by its attributes, which count toward the limit as
/// in SQS, is [`Error::MessageTooLarge`], alone or in a batch. A worker
/// whose receives could only be such requests is refused when it is
/// built. At the limits the same calls run.
///
/// Needs: an empty standard queue.
pub async fn conformance_requests_past_the_limits_are_refused<Q: Queue + Clone + 'static>(q: &Q) {
    let invalid = |what: &str, r: Result<(), Error>| {
        assert!(matches!(r, Err(Error::Invalid { .. })), "{what}: {r:?}");
    };
    invalid("empty send batch", q.send_batch(Vec::new()).await.map(drop));
    let too_many = vec![SendMessage::new("x"); MAX_BATCH + 1];
    invalid(
        "send batch past MAX_BATCH",
        q.send_batch(too_many).await.map(drop),
    );
    let receipts = vec![Receipt("stale".into()); MAX_BATCH + 1];
    invalid(
        "delete batch past MAX_BATCH",
        q.delete_batch(&receipts).await.map(drop),
    );
    // A short body and an attribute that take it past the limit together.
    let large = SendMessage::new("x").attribute("large", "x".repeat(MAX_BODY_BYTES));
    let too_large = |what: &str, r: Result<(), Error>| {
        assert!(
            matches!(r, Err(Error::MessageTooLarge { .. })),
            "{what}: {r:?}"
        );
    };
    too_large(
        "a message past the limit by its attributes",
        q.send(large.clone()).await.map(drop),
    );
    too_large(
        "a batch with a message past the limit by its attributes",
        q.send_batch(vec![SendMessage::new("x"), large])
            .await
            .map(drop),
    );
    // A message is waiting, so that a receive let through returns at once
    // (and fails the check) rather than waiting out its wait.
    q.send(SendMessage::new("probe")).await.unwrap();
    let over = Duration::from_millis(1);
    for (what, request) in [
        ("receive of none", ReceiveRequest::up_to(0)),
        (
            "receive past MAX_BATCH",
            ReceiveRequest::up_to(MAX_BATCH + 1),
        ),
        (
            "visibility past MAX_VISIBILITY",
            ReceiveRequest::up_to(1).visibility(MAX_VISIBILITY + over),
        ),
        (
            "wait past MAX_WAIT",
            ReceiveRequest::up_to(1).wait(MAX_WAIT + over),
        ),
        (
            "wait of Duration::MAX",
            ReceiveRequest::up_to(1).wait(Duration::MAX),
        ),
    ] {
        invalid(what, q.receive(request).await.map(drop));
    }
    for config in [
        WorkerConfig {
            batch: MAX_BATCH + 1,
            concurrency: MAX_BATCH + 1,
            ..WorkerConfig::default()
        },
        WorkerConfig {
            wait: Duration::MAX,
            ..WorkerConfig::default()
        },
        WorkerConfig {
            visibility: Some(MAX_VISIBILITY + over),
            heartbeat_interval: None,
            ..WorkerConfig::default()
        },
        WorkerConfig {
            failure_visibility: Some(MAX_VISIBILITY + over),
            ..WorkerConfig::default()
        },
        WorkerConfig {
            concurrency: usize::MAX,
            ..WorkerConfig::default()
        },
    ] {
        let handler = Succeeds(Arc::new(Recording::new()));
        invalid(
            "worker config",
            Worker::new(q.clone(), handler, config).map(drop),
        );
    }
    // At the limits the same calls run, and find the one message sent.
    let request = ReceiveRequest::up_to(MAX_BATCH)
        .visibility(MAX_VISIBILITY)
        .wait(MAX_WAIT);
    let got = q.receive(request).await.unwrap();
    assert_eq!(
        got.iter().map(|m| m.body.as_str()).collect::<Vec<_>>(),
        ["probe"]
    );
    q.delete(&got[0].receipt).await.unwrap();
}

/// Needs: an empty standard queue with a 1 s visibility timeout.
pub async fn conformance_stale_receipt(q: &impl Queue) {
    q.send(SendMessage::new("fenced")).await.unwrap();
    let first = receive_n(q, 1, Duration::from_secs(10)).await.remove(0);
    // Wait out the timeout: the message is redelivered.
    let second = receive_n(q, 1, Duration::from_secs(10)).await.remove(0);
    assert_eq!(first.id, second.id);
    assert!(second.receive_count > first.receive_count);
    assert_ne!(first.receipt, second.receipt);
    assert!(
        matches!(
            q.change_visibility(&first.receipt, Duration::ZERO).await,
            Err(Error::StaleReceipt { .. })
        ),
        "a stale receipt extends nothing"
    );
    assert!(
        matches!(
            q.delete(&first.receipt).await,
            Err(Error::StaleReceipt { .. })
        ),
        "a stale receipt deletes nothing"
    );
    let still = q.stats().await.unwrap();
    assert_eq!(
        still.in_flight, 1,
        "the redelivered message is still there and still invisible"
    );
    q.delete(&second.receipt)
        .await
        .expect("the current receipt deletes");
}

/// `receipt`, presented to `q`, hides nothing, deletes nothing, and a batch
/// of it reports it stale: each refusal is [`Error::StaleReceipt`].
async fn refused(q: &impl Queue, receipt: &Receipt, when: &str) {
    let name = q.name();
    assert!(
        matches!(
            q.change_visibility(receipt, Duration::from_secs(12 * 3600))
                .await,
            Err(Error::StaleReceipt { .. })
        ),
        "{receipt} hides nothing in {name} {when}"
    );
    assert!(
        matches!(q.delete(receipt).await, Err(Error::StaleReceipt { .. })),
        "{receipt} deletes nothing in {name} {when}"
    );
    let one = std::slice::from_ref(receipt);
    assert_eq!(
        q.delete_batch(one).await.expect("delete_batch"),
        one,
        "{receipt} is stale in a batch in {name} {when}"
    );
}

/// Dead letters: a message received `max_receive_count` (2) times without
/// a delete moves to the dead-letter queue on the next receive, with its
/// body; redrive moves it back, receivable and deletable.
///
/// Receipts across the moves: a receipt is good for one delivery in one
/// queue, so the last source delivery's receipt neither deletes nor hides
/// the message in the dead-letter queue, nor after the redrive, and the
/// dead-letter delivery's receipt does not act on it back in the source
/// queue.
///
/// Needs: empty queues, `q` standard with dead-letter queue `dlq` and max
/// receive count 2.
pub async fn conformance_dead_letter_and_redrive(q: &impl Queue, dlq: &impl Queue) {
    conformance_dead_letter_and_redrive_with(q, dlq, Caveats::NONE).await
}

/// [`conformance_dead_letter_and_redrive`], skipping what `caveats` names.
pub async fn conformance_dead_letter_and_redrive_with(
    q: &impl Queue,
    dlq: &impl Queue,
    caveats: Caveats,
) {
    let sent = q.send(SendMessage::new("poison")).await.unwrap();
    let mut last = None;
    for attempt in 1..=2u32 {
        let m = receive_n(q, 1, Duration::from_secs(10)).await.remove(0);
        assert_eq!(
            (m.id.as_str(), m.receive_count),
            (sent.id.as_str(), attempt)
        );
        q.change_visibility(&m.receipt, Duration::ZERO)
            .await
            .unwrap(); // failed
        last = Some(m.receipt);
    }
    let last = last.unwrap();
    let none = q
        .receive(ReceiveRequest::up_to(10).wait(Duration::from_secs(1)))
        .await
        .unwrap();
    assert!(
        none.is_empty(),
        "the third receive moves it instead: {none:?}"
    );
    let stats = q.stats().await.unwrap();
    assert_eq!((stats.depth, stats.in_flight), (0, 0));
    assert_eq!(stats.dead_letter_depth, Some(1));
    if caveats.fences_receipts {
        refused(q, &last, "after the move").await;
        refused(dlq, &last, "after the move").await;
    }

    let dead = receive_n(dlq, 1, Duration::from_secs(10)).await.remove(0);
    assert_eq!(
        (dead.id.as_str(), dead.body.as_str()),
        (sent.id.as_str(), "poison")
    );
    dlq.change_visibility(&dead.receipt, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    if caveats.fences_receipts {
        for receipt in [&last, &dead.receipt] {
            refused(q, receipt, "after the redrive").await;
            refused(dlq, receipt, "after the redrive").await;
        }
    }
    let back = receive_n(q, 1, Duration::from_secs(10)).await.remove(0);
    assert_eq!(
        (back.id.as_str(), back.body.as_str()),
        (sent.id.as_str(), "poison")
    );
    if caveats.fences_receipts {
        assert!(
            matches!(
                dlq.delete(&dead.receipt).await,
                Err(Error::StaleReceipt { .. })
            ),
            "the dead-letter delivery's receipt is stale after the redrive"
        );
    }
    q.delete(&back.receipt).await.unwrap();
    assert_eq!(q.stats().await.unwrap().dead_letter_depth, Some(0));
}

/// Deduplication: within the window, a send with a seen deduplication id
/// returns the original id and enqueues nothing, even after the original
/// was deleted.
///
/// Needs: an empty queue (standard or FIFO) with a window of 10 s or more.
pub async fn conformance_dedup_within_window(q: &impl Queue) {
    conformance_dedup_within_window_with(q, Caveats::NONE).await
}

/// [`conformance_dedup_within_window`], skipping what `caveats` names. The
/// core holds on every backend: a duplicate enqueues nothing.
pub async fn conformance_dedup_within_window_with(q: &impl Queue, caveats: Caveats) {
    let msg = |body: &str| {
        let m = SendMessage::new(body).dedup("order-17");
        if q.is_fifo() { m.group("g") } else { m }
    };
    let first = q.send(msg("first")).await.unwrap();
    assert!(!first.duplicate);
    let again = q.send(msg("second")).await.unwrap();
    if caveats.reports_duplicates {
        assert_eq!(again.id, first.id, "the original id");
        assert!(again.duplicate);
    }
    let got = receive_n(q, 1, Duration::from_secs(10)).await;
    assert_eq!(got[0].body, "first");
    let more = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert!(more.is_empty(), "the duplicate enqueued nothing: {more:?}");
    q.delete(&got[0].receipt).await.unwrap();
    let after_delete = q.send(msg("third")).await.unwrap();
    if caveats.reports_duplicates {
        assert_eq!(after_delete.id, first.id, "still a duplicate after delete");
    }
    if caveats.dedup_survives_delete {
        let none = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
        assert!(
            none.is_empty(),
            "a duplicate after delete enqueued: {none:?}"
        );
    }
}

/// Deduplication: once the window is over, the same id enqueues again.
///
/// Needs: an empty queue whose deduplication window is `window` (short).
pub async fn conformance_dedup_window_expires(q: &impl Queue, window: Duration) {
    let msg = SendMessage::new("x").dedup("again");
    let msg = if q.is_fifo() { msg.group("g") } else { msg };
    let first = q.send(msg.clone()).await.unwrap();
    tokio::time::sleep(window + Duration::from_millis(200)).await;
    let second = q.send(msg).await.unwrap();
    assert!(!second.duplicate);
    assert_ne!(second.id, first.id);
}

/// Long polling: a receive parked on an empty queue returns as soon as a
/// message is sent, long before its wait time. `parked` resolves once the
/// receive is waiting (the backend knows how to tell).
///
/// Needs: an empty standard queue, and a backend that does not re-poll
/// more often than every 20 s on its own.
pub async fn conformance_long_poll_wakes_on_send(q: &impl Queue, parked: impl Future<Output = ()>) {
    let wait = Duration::from_secs(20);
    let started = Instant::now();
    let receive = async {
        let got = q
            .receive(ReceiveRequest::up_to(1).wait(wait))
            .await
            .expect("receive");
        (got, started.elapsed())
    };
    let send = async {
        parked.await;
        q.send(SendMessage::new("wake up")).await.unwrap();
    };
    let ((got, took), ()) = tokio::join!(receive, send);
    assert_eq!(got.len(), 1, "the send woke the receive");
    assert!(
        took < wait / 4,
        "returned after {took:?}, wait was {wait:?}"
    );
}

/// A gate-held handler for the shutdown case.
struct Gated {
    rec: Arc<Recording>,
    gate: Arc<Semaphore>,
}

impl Handler for Gated {
    async fn handle(&self, m: &Received) -> Result<(), HandlerError> {
        self.rec.start(m);
        if m.body == "forever" {
            std::future::pending::<()>().await;
        }
        self.gate.acquire().await.unwrap().forget();
        Ok(())
    }
}

/// `worker.run`, until the sender returned is used (or dropped).
fn run_until_told<Q: Queue + 'static, H: Handler>(
    worker: &Worker<Q, H>,
) -> (
    impl Future<Output = super::WorkerCounters> + '_,
    tokio::sync::oneshot::Sender<()>,
) {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = worker.run(async {
        let _ = stop_rx.await;
    });
    (run, stop_tx)
}

/// Graceful shutdown: on shutdown the worker stops receiving (messages sent
/// afterwards stay in the queue), lets in-flight handlers finish within the
/// deadline (their messages are deleted), and abandons the rest, whose
/// messages it hands back, receivable again at once (not after their
/// visibility timeout).
///
/// Needs: an empty standard queue with a visibility timeout of 30 s or more.
pub async fn conformance_shutdown<Q: Queue + Clone + 'static>(q: &Q) {
    q.send_batch(vec![
        SendMessage::new("a"),
        SendMessage::new("b"),
        SendMessage::new("forever"),
    ])
    .await
    .unwrap();
    let rec = Arc::new(Recording::new());
    let gate = Arc::new(Semaphore::new(0));
    let handler = Gated {
        rec: rec.clone(),
        gate: gate.clone(),
    };
    let config = WorkerConfig {
        concurrency: 3,
        batch: 3,
        wait: Duration::from_secs(1),
        heartbeat_interval: None,
        shutdown_deadline: Duration::from_secs(2),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(q.clone(), handler, config).unwrap();
    let (run, stop_tx) = run_until_told(&worker);
    let drive = async {
        tokio::time::timeout(Duration::from_secs(20), rec.wait_started(3))
            .await
            .expect("all three handlers start");
        // Every slot is busy: the worker cannot receive these before the
        // shutdown, and must not after it.
        q.send_batch(vec![SendMessage::new("late-1"), SendMessage::new("late-2")])
            .await
            .unwrap();
        let _ = stop_tx.send(());
        gate.add_permits(2); // a and b finish after the shutdown began
    };
    let started = Instant::now();
    let (counters, ()) = tokio::join!(run, drive);
    assert!(started.elapsed() < Duration::from_secs(15));
    assert_eq!(counters.received, 3, "nothing received after shutdown");
    assert_eq!(
        (counters.succeeded, counters.deleted),
        (2, 2),
        "in-flight work finished and acked"
    );
    assert_eq!(
        (counters.abandoned, counters.released),
        (1, 1),
        "the handler past the deadline was dropped, its message handed back"
    );
    let stats = q.stats().await.unwrap();
    assert_eq!(
        (stats.depth, stats.in_flight),
        (3, 0),
        "the late messages are still there, and the abandoned one is back"
    );
}

/// Shutdown during a long poll: a message sent after the shutdown, while
/// the worker's receive is under way, is not handled, and is in the queue
/// receivable, not in flight. The receive either gave up waiting (the
/// backend can tell it was only waiting) or finished and the worker handed
/// the message back; dropped, the receive could take the message with it,
/// invisible for its visibility timeout. `receiving` resolves once the
/// worker's receive is under way (the backend knows how to tell).
///
/// Needs: an empty standard queue with a visibility timeout of 30 s or
/// more.
pub async fn conformance_shutdown_during_a_long_poll<Q: Queue + Clone + 'static>(
    q: &Q,
    receiving: impl Future<Output = ()>,
) {
    let rec = Arc::new(Recording::new());
    let handler = Gated {
        rec: rec.clone(),
        gate: Arc::new(Semaphore::new(0)),
    };
    let config = WorkerConfig {
        concurrency: 1,
        batch: 1,
        wait: Duration::from_secs(10),
        heartbeat_interval: None,
        shutdown_deadline: Duration::from_secs(20),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(q.clone(), handler, config).unwrap();
    let (run, stop_tx) = run_until_told(&worker);
    let drive = async {
        tokio::time::timeout(Duration::from_secs(20), receiving)
            .await
            .expect("the worker receives");
        let _ = stop_tx.send(());
        q.send(SendMessage::new("after the shutdown"))
            .await
            .unwrap();
    };
    let (counters, ()) =
        tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(run, drive) })
            .await
            .expect("run ends");
    assert_eq!(counters.received, 0, "nothing handled after the shutdown");
    let stats = q.stats().await.unwrap();
    assert_eq!(
        (stats.depth, stats.in_flight),
        (1, 0),
        "the message sent after the shutdown is receivable"
    );
}

/// Shutdown after a redelivery: a handler still running at the shutdown
/// deadline whose delivery ran out (here: a 1 s visibility, no heartbeat),
/// the message meanwhile delivered to another consumer, is abandoned
/// without touching that consumer's delivery: the message stays hidden
/// under it, not receivable by a third. A backend that fences receipts
/// refuses the abandoned handler's hand-back as stale; one that does not
/// (SQS) would carry it out, and the worker must not send it.
///
/// Needs: an empty standard queue.
pub async fn conformance_shutdown_after_a_redelivery<Q: Queue + Clone + 'static>(q: &Q) {
    q.send(SendMessage::new("m")).await.unwrap();
    let rec = Arc::new(Recording::new());
    let config = WorkerConfig {
        concurrency: 1,
        batch: 1,
        visibility: Some(Duration::from_secs(1)),
        heartbeat_interval: None,
        shutdown_deadline: Duration::ZERO,
        ..WorkerConfig::default()
    };
    let worker = Worker::new(q.clone(), Hangs(rec.clone()), config).unwrap();
    let mut other = Vec::new();
    let shutdown = async {
        rec.wait_started(1).await;
        other = taken_by_another_consumer(q).await;
    };
    let counters = tokio::time::timeout(Duration::from_secs(60), worker.run(shutdown))
        .await
        .expect("run ends");
    let third = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert!(
        third.is_empty(),
        "the other consumer's delivery was made visible by the abandoned handler's hand-back"
    );
    assert_eq!(
        (other.len(), counters.abandoned, counters.released),
        (1, 1, 0),
        "the handler was abandoned after the message went to another consumer"
    );
    q.delete(&other[0].receipt).await.unwrap();
}

/// The message delivered to another consumer for an hour, received once
/// the worker's delivery of it has run out.
async fn taken_by_another_consumer<Q: Queue>(q: &Q) -> Vec<Received> {
    loop {
        let other = q
            .receive(
                ReceiveRequest::up_to(1)
                    .visibility(Duration::from_secs(3600))
                    .wait(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        if !other.is_empty() {
            return other;
        }
    }
}

/// Fails once `release` is notified: a handler that outlives its
/// delivery, then fails.
struct FailsWhenReleased(Arc<Recording>, Arc<Notify>);

impl Handler for FailsWhenReleased {
    async fn handle(&self, m: &Received) -> Result<(), HandlerError> {
        self.0.start(m);
        self.1.notified().await;
        Err("failed after its delivery ran out".into())
    }
}

/// A failure after a redelivery: a handler that fails after its delivery
/// ran out (a 1 s visibility, no heartbeat), the message meanwhile
/// delivered to another consumer, does not set the visibility its failure
/// asks for (`failure_visibility` zero: visible again at once) on that
/// consumer's delivery. A backend that fences receipts refuses the stale
/// receipt; one that does not (SQS) would make the other delivery visible
/// for a third consumer, and the worker must not send it.
///
/// Needs: an empty standard queue.
pub async fn conformance_failure_after_a_redelivery<Q: Queue + Clone + 'static>(q: &Q) {
    q.send(SendMessage::new("m")).await.unwrap();
    let rec = Arc::new(Recording::new());
    let release = Arc::new(Notify::new());
    let config = WorkerConfig {
        concurrency: 1,
        batch: 1,
        visibility: Some(Duration::from_secs(1)),
        heartbeat_interval: None,
        failure_visibility: Some(Duration::ZERO),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(
        q.clone(),
        FailsWhenReleased(rec.clone(), release.clone()),
        config,
    )
    .unwrap();
    let mut other = Vec::new();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = worker.run(async {
        let _ = stopped.await;
    });
    let drive = async {
        rec.wait_started(1).await;
        other = taken_by_another_consumer(q).await;
        release.notify_one();
        // The worker lets the handler finish, its ack included, before
        // `run` returns.
        let _ = stop.send(());
    };
    let (counters, ()) =
        tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(run, drive) })
            .await
            .expect("run ends");
    let third = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert!(
        third.is_empty(),
        "the other consumer's delivery was made visible by the failed handler's ack"
    );
    assert_eq!(
        (other.len(), counters.failed),
        (1, 1),
        "the handler failed after the message went to another consumer"
    );
    q.delete(&other[0].receipt).await.unwrap();
}

/// `Q` whose visibility changes fail, as over a network that drops them,
/// until [`BeatsFail::heal`] is called; everything else goes to `Q`.
#[derive(Clone)]
struct BeatsFail<Q> {
    queue: Q,
    failing: Arc<std::sync::atomic::AtomicBool>,
}

impl<Q: Queue> BeatsFail<Q> {
    fn new(queue: Q) -> BeatsFail<Q> {
        BeatsFail {
            queue,
            failing: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }

    /// Visibility changes go through from now on.
    fn heal(&self) {
        self.failing.store(false, Ordering::SeqCst);
    }
}

impl<Q: Queue> Queue for BeatsFail<Q> {
    fn name(&self) -> &str {
        self.queue.name()
    }

    fn is_fifo(&self) -> bool {
        self.queue.is_fifo()
    }

    async fn send(&self, message: SendMessage) -> crate::Result<super::Sent> {
        self.queue.send(message).await
    }

    async fn send_batch(&self, messages: Vec<SendMessage>) -> crate::Result<Vec<super::Sent>> {
        self.queue.send_batch(messages).await
    }

    async fn receive(&self, request: ReceiveRequest) -> crate::Result<Vec<Received>> {
        self.queue.receive(request).await
    }

    async fn receive_or_stop(
        &self,
        request: ReceiveRequest,
        stop: impl Future<Output = ()> + Send,
    ) -> crate::Result<Vec<Received>> {
        self.queue.receive_or_stop(request, stop).await
    }

    async fn delete(&self, receipt: &Receipt) -> crate::Result<()> {
        self.queue.delete(receipt).await
    }

    async fn delete_batch(&self, receipts: &[Receipt]) -> crate::Result<Vec<Receipt>> {
        self.queue.delete_batch(receipts).await
    }

    async fn change_visibility(&self, receipt: &Receipt, timeout: Duration) -> crate::Result<()> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(Error::Unavailable {
                backend: "test",
                reason: "visibility changes fail until healed".into(),
            });
        }
        self.queue.change_visibility(receipt, timeout).await
    }

    async fn purge(&self) -> crate::Result<u64> {
        self.queue.purge().await
    }

    async fn stats(&self) -> crate::Result<super::QueueStats> {
        self.queue.stats().await
    }

    async fn redrive(&self) -> crate::Result<u64> {
        self.queue.redrive().await
    }
}

/// A heartbeat after a redelivery: a handler whose beats fail (here: its
/// visibility changes are dropped) until its delivery ran out (a 1 s
/// visibility), the message meanwhile delivered to another consumer for an
/// hour, sends no more beats once they would go through again: a beat then
/// would cut the other consumer's delivery short, to the 1 s extension
/// from the beat, on a backend that does not fence receipts (SQS), and
/// make the message receivable by a third consumer while the second
/// still handles it. A backend that fences receipts would refuse the beat
/// as stale; the worker does not send it on either, and counts the
/// delivery in [`super::WorkerCounters::expired`].
///
/// Step by step: the handler starts; once another consumer has the
/// message, visibility changes go through again; once the worker has
/// looked again (a beat, through or refused, or the heartbeat stopped),
/// the handler fails (no `failure_visibility`: the visibility is left
/// alone); then a third consumer waits 3 s, past the extension, for the
/// message.
///
/// Needs: an empty standard queue.
pub async fn conformance_heartbeat_after_a_redelivery<Q: Queue + Clone + 'static>(q: &Q) {
    heartbeat_after_a_redelivery(q, Some(Duration::from_secs(1))).await;
}

/// [`conformance_heartbeat_after_a_redelivery`] with the worker asking for
/// no visibility of its own: its deliveries get the queue's 1 s timeout,
/// which the worker learns from each delivery
/// ([`Received::visibility`]), so it knows when one ran out before any
/// beat went through.
///
/// Needs: an empty standard queue with a 1 s visibility timeout.
pub async fn conformance_heartbeat_after_the_queue_visibility_ran_out<
    Q: Queue + Clone + 'static,
>(
    q: &Q,
) {
    heartbeat_after_a_redelivery(q, None).await;
}

/// A delivery states the visibility it got ([`Received::visibility`]): the
/// queue's timeout when the receive asks for none, else the receive's, as
/// the backend took it (rounded up to whole seconds at most); and when the
/// request that delivered it began ([`Received::requested_at`]), within
/// the receive call. A consumer counts from the two when its delivery runs
/// out.
///
/// Needs: an empty standard queue with a 1 s visibility timeout.
pub async fn conformance_deliveries_state_their_visibility(q: &impl Queue) {
    q.send_batch(vec![SendMessage::new("a"), SendMessage::new("b")])
        .await
        .unwrap();
    let began = Instant::now();
    let queues = receive_n(q, 1, Duration::from_secs(10)).await;
    requested_within(&queues[0], began, Instant::now());
    assert_eq!(
        queues[0].visibility,
        Some(Duration::from_secs(1)),
        "a receive asking for no visibility: the queue's"
    );
    let asked = Duration::from_millis(2500);
    let own = loop {
        let began = Instant::now();
        let got = q
            .receive(
                ReceiveRequest::up_to(1)
                    .visibility(asked)
                    .wait(Duration::from_secs(2)),
            )
            .await
            .unwrap();
        if let Some(m) = got.into_iter().next() {
            requested_within(&m, began, Instant::now());
            break m;
        }
    };
    assert!(
        own.visibility
            .is_some_and(|v| v >= asked && v <= Duration::from_secs(3)),
        "a receive asking for {asked:?}: that, rounded up to whole seconds at most; got {:?}",
        own.visibility
    );
    q.delete(&own.receipt).await.unwrap();
    q.delete(&queues[0].receipt).await.ok();
}

/// `m` was delivered by a request begun within the receive call that
/// ran from `began` to `ended`: a consumer counting from it never counts
/// from after the server did, nor from before the call.
fn requested_within(m: &Received, began: Instant, ended: Instant) {
    assert!(
        began <= m.requested_at && m.requested_at <= ended,
        "requested_at {:?} is outside the receive call's {:?} (from {:?} to {:?})",
        m.requested_at,
        ended - began,
        began,
        ended
    );
}

/// The steps of [`conformance_heartbeat_after_a_redelivery`], the worker
/// asking for `visibility` (1 s, or `None`: the queue's, 1 s).
async fn heartbeat_after_a_redelivery<Q: Queue + Clone + 'static>(
    q: &Q,
    visibility: Option<Duration>,
) {
    q.send(SendMessage::new("m")).await.unwrap();
    let rec = Arc::new(Recording::new());
    let release = Arc::new(Notify::new());
    let beats = BeatsFail::new(q.clone());
    let config = WorkerConfig {
        concurrency: 1,
        batch: 1,
        visibility,
        heartbeat_interval: Some(Duration::from_millis(300)),
        heartbeat_extension: Duration::from_secs(1),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(
        beats.clone(),
        FailsWhenReleased(rec.clone(), release.clone()),
        config,
    )
    .unwrap();
    let drive = async {
        rec.wait_started(1).await;
        let other = taken_by_another_consumer(q).await;
        beats.heal();
        loop {
            let c = worker.counters();
            if c.heartbeats + c.stale + c.expired > 0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        release.notify_one();
        other
    };
    let (done, other) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(worker.run_once(), drive)
    })
    .await
    .expect("run_once ends");
    let done = done.expect("run_once");
    let third = q
        .receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(3)))
        .await
        .unwrap();
    assert!(
        third.is_empty(),
        "a heartbeat after the delivery ran out cut the other consumer's delivery short: {done:?}"
    );
    assert_eq!(
        (done.expired, done.heartbeats, done.failed),
        (1, 0, 1),
        "the heartbeat stopped once the delivery ran out"
    );
    q.delete(&other[0].receipt).await.unwrap();
}

/// Parses a JSON body; malformed bodies fail.
struct ParsesJson(Arc<Mutex<Vec<String>>>);

impl Handler for ParsesJson {
    async fn handle(&self, m: &Received) -> Result<(), HandlerError> {
        match serde_json::from_str::<serde_json::Value>(&m.body) {
            Ok(_) => Ok(()),
            Err(e) => {
                self.0.lock().unwrap().push(m.body.clone());
                Err(Box::new(e))
            }
        }
    }
}

/// Malformed bodies reach the handler's error path on each delivery, then
/// the dead-letter queue; they never vanish. Well-formed ones are acked.
///
/// Needs: empty queues, `q` standard with dead-letter queue `dlq` and max
/// receive count 2.
pub async fn conformance_malformed_bodies_reach_dead_letters(
    q: &(impl Queue + Clone + 'static),
    dlq: &impl Queue,
) {
    q.send_batch(vec![
        SendMessage::new(r#"{"n":1}"#),
        SendMessage::new("{oops"),
    ])
    .await
    .unwrap();
    let errors = Arc::new(Mutex::new(Vec::new()));
    let config = WorkerConfig {
        concurrency: 4,
        batch: 4,
        heartbeat_interval: None,
        failure_visibility: Some(Duration::ZERO),
        ack: AckPolicy::DeleteOnSuccess,
        ..WorkerConfig::default()
    };
    let worker = Worker::new(q.clone(), ParsesJson(errors.clone()), config).unwrap();
    let mut total = super::WorkerCounters::default();
    for _ in 0..20 {
        let c = worker.run_once().await.expect("run_once");
        total.received += c.received;
        total.succeeded += c.succeeded;
        total.failed += c.failed;
        let s = q.stats().await.unwrap();
        if s.depth + s.in_flight == 0 {
            break;
        }
    }
    assert_eq!(total.succeeded, 1, "the well-formed message is handled");
    assert_eq!(
        *errors.lock().unwrap(),
        vec!["{oops".to_string(), "{oops".to_string()],
        "the malformed one reached the error path once per delivery"
    );
    let dead = receive_n(dlq, 1, Duration::from_secs(10)).await;
    assert_eq!(dead[0].body, "{oops", "and then the dead-letter queue");
}

/// Heartbeat: while a handler runs past the visibility timeout, the worker
/// keeps extending it, so nobody else receives the message; then it acks.
///
/// Needs: an empty standard queue with a 1 s visibility timeout.
pub async fn conformance_heartbeat_keeps_message_invisible<Q: Queue + Clone + 'static>(q: &Q) {
    q.send(SendMessage::new("slow")).await.unwrap();
    let rec = Arc::new(Recording::new());
    let gate = Arc::new(Semaphore::new(0));
    let config = WorkerConfig {
        concurrency: 1,
        batch: 1,
        heartbeat_interval: Some(Duration::from_millis(300)),
        heartbeat_extension: Duration::from_secs(1),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(
        q.clone(),
        Gated {
            rec: rec.clone(),
            gate: gate.clone(),
        },
        config,
    )
    .unwrap();
    let check = async {
        rec.wait_started(1).await;
        let other = q
            .receive(ReceiveRequest::up_to(1).wait(Duration::from_millis(2500)))
            .await
            .unwrap();
        gate.add_permits(1);
        other
    };
    let (counters, other) = tokio::join!(worker.run_once(), check);
    let counters = counters.unwrap();
    assert!(
        other.is_empty(),
        "received by another consumer mid-handler: {other:?}"
    );
    assert!(counters.heartbeats >= 2, "{counters:?}");
    assert_eq!(counters.deleted, 1);
}
