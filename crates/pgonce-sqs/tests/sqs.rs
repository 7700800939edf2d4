//! The SQS backend against moto's server mode (one throwaway moto server
//! per test, on a free loopback port, stopped on drop): the same
//! conformance functions `crates/pgonce/tests/queue.rs` runs on PostgreSQL,
//! so the worker runtime is proven on both backends; then what is SQS's own:
//! typed errors for a closed or silent endpoint within the operation
//! timeout, bad input rejected before any request.
//!
//! Where moto or SQS differs from the contract, the test says so: a
//! `Caveats` field (a skipped assertion, with the reason), or a skip reason
//! in a test that cannot run here.

mod support;

use std::future::Future;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use pgonce::queue::conformance::*;
use pgonce::{Error, Queue, QueueAttributes, Receipt, ReceiveRequest, SendMessage};
use pgonce_sqs::{SqsClient, SqsConfig, SqsQueue};
use pgonce_testkit::wait_until;
use support::Moto;

/// A fresh moto with one queue; keep the `Moto` alive for the test.
async fn started(name: &str, attributes: QueueAttributes) -> (Moto, SqsQueue) {
    let moto = support::start();
    let q = support::client(&moto)
        .await
        .create_queue(name, attributes)
        .await
        .unwrap();
    (moto, q)
}

fn one_second() -> QueueAttributes {
    QueueAttributes::default().visibility_timeout(Duration::from_secs(1))
}

async fn with_dead_letters(sqs: &SqsClient) -> (SqsQueue, SqsQueue) {
    dead_lettered(sqs, "jobs", "jobs-dlq", QueueAttributes::default()).await
}

/// Queue `name` with `attributes`, whose messages move to `dead` (of the
/// same attributes) after 2 receives.
async fn dead_lettered(
    sqs: &SqsClient,
    name: &str,
    dead: &str,
    attributes: QueueAttributes,
) -> (SqsQueue, SqsQueue) {
    let dlq = sqs.create_queue(dead, attributes.clone()).await.unwrap();
    let q = sqs
        .create_queue(name, attributes.dead_letter(dead, 2))
        .await
        .unwrap();
    (q, dlq)
}

/// SQS does not fence receipts (an earlier delivery's handle "succeeds, but
/// the message might not be deleted"), and moto accepts every handle a
/// message ever had. pgonce's database safeguards, not the queue, make a
/// second delivery harmless.
const SQS: Caveats = Caveats {
    fences_receipts: false,
    // SQS reports no "duplicate" flag on send; moto even returns a fresh
    // MessageId for the dropped duplicate.
    reports_duplicates: false,
    // moto-only: moto forgets a deduplication id once its message is
    // deleted (real SQS keeps it for the 5-minute window).
    dedup_survives_delete: false,
    // moto-only: moto's FIFO group lock is not atomic across concurrent
    // ReceiveMessage requests (each takes a snapshot of the locked groups,
    // then picks); seen here as "two messages of g0 in flight at once",
    // gone with receives serialised. Real SQS locks the group atomically.
    receives_atomic: false,
};

#[tokio::test]
async fn at_least_once_when_a_consumer_dies_mid_handler() {
    let (_moto, q) = started("q", one_second()).await;
    conformance_at_least_once_when_consumer_dies(&q).await;
    let s = q.stats().await.unwrap();
    assert_eq!((s.depth, s.in_flight), (0, 0), "every message deleted");
}

#[tokio::test]
async fn fifo_order_holds_with_many_consumers() {
    let (_moto, q) = started("f.fifo", QueueAttributes::fifo()).await;
    conformance_fifo_order_with_many_consumers_with(&q, SQS).await;
}

#[tokio::test]
async fn fifo_groups_are_independent() {
    let (_moto, q) = started("f.fifo", QueueAttributes::fifo()).await;
    conformance_fifo_groups_are_independent(&q).await;
}

#[tokio::test]
async fn requests_past_the_limits_are_refused() {
    let (_moto, q) = started("q", one_second()).await;
    conformance_requests_past_the_limits_are_refused(&q).await;
}

#[tokio::test]
#[ignore = "SQS does not fence receipts: an earlier delivery's handle is accepted \
            (moto accepts every handle a message ever had); see Caveats::fences_receipts"]
async fn a_stale_receipt_deletes_and_extends_nothing() {
    let (_moto, q) = started("q", one_second()).await;
    conformance_stale_receipt(&q).await;
}

#[tokio::test]
async fn dead_letter_and_redrive() {
    let moto = support::start();
    let (q, dlq) = with_dead_letters(&support::client(&moto).await).await;
    conformance_dead_letter_and_redrive_with(&q, &dlq, SQS).await;
}

/// A FIFO queue with content-based deduplication: a message sent without a
/// deduplication id is deduplicated by its body, as SQS does when it is
/// given none (the backend used to give every such message a fresh id).
#[tokio::test]
async fn content_based_deduplication_deduplicates_by_body() {
    let attributes = QueueAttributes {
        content_based_dedup: true,
        ..QueueAttributes::fifo()
    };
    let (_moto, q) = started("c.fifo", attributes).await;
    for body in ["same", "same", "other"] {
        q.send(SendMessage::new(body).group("g")).await.unwrap();
    }
    let mut bodies = Vec::new();
    loop {
        let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
        let Some(m) = got.first() else { break };
        bodies.push(m.body.clone());
        q.delete(&m.receipt).await.unwrap();
    }
    assert_eq!(bodies, ["same", "other"]);
}

#[tokio::test]
async fn dedup_within_the_window_enqueues_once() {
    let (_moto, q) = started("f.fifo", QueueAttributes::fifo()).await;
    conformance_dedup_within_window_with(&q, SQS).await;
}

#[tokio::test]
#[ignore = "SQS's deduplication window is fixed at 5 minutes: too long for a test"]
async fn dedup_window_expires() {
    let (_moto, q) = started("f.fifo", QueueAttributes::fifo()).await;
    conformance_dedup_window_expires(&q, pgonce_sqs::SQS_DEDUP_WINDOW).await;
}

#[tokio::test]
async fn a_long_poll_wakes_on_send_not_on_its_timer() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    // Our receive call is under way (the request may not have reached moto
    // yet; then the send comes first and the receive finds the message at
    // once, which passes as well).
    let parked = wait_until("a receive in flight", || async {
        q.receives_in_flight() > 0
    });
    conformance_long_poll_wakes_on_send(&q, parked).await;
}

#[tokio::test]
async fn graceful_shutdown() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    conformance_shutdown(&q).await;
}

/// SQS cannot tell a receive waiting from one delivering: the worker lets
/// the long poll finish and hands back what it returned.
#[tokio::test]
async fn a_shutdown_during_a_long_poll_leaves_later_messages_receivable() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    let receiving = wait_until("a receive in flight", || async {
        q.receives_in_flight() > 0
    });
    conformance_shutdown_during_a_long_poll(&q, receiving).await;
}

/// SQS takes an earlier delivery's handle: the worker must not hand back
/// a message whose delivery ran out, or it makes another consumer's
/// delivery visible.
#[tokio::test]
async fn a_shutdown_after_a_redelivery_leaves_the_other_delivery_alone() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    conformance_shutdown_after_a_redelivery(&q).await;
}

/// Likewise for a handler that fails after its delivery ran out: its
/// failure's visibility change must not reach the other delivery.
#[tokio::test]
async fn a_failure_after_a_redelivery_leaves_the_other_delivery_alone() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    conformance_failure_after_a_redelivery(&q).await;
}

/// Likewise for a heartbeat once the delivery ran out: SQS takes it, and
/// it would cut the other delivery short (a heartbeat extension from now
/// instead of its hour).
#[tokio::test]
async fn a_heartbeat_after_a_redelivery_leaves_the_other_delivery_alone() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    conformance_heartbeat_after_a_redelivery(&q).await;
}

#[tokio::test]
async fn deliveries_state_their_visibility() {
    let (_moto, q) = started("q", one_second()).await;
    conformance_deliveries_state_their_visibility(&q).await;
}

/// As above, the worker asking for no visibility of its own: it learns the
/// queue's (1 s) from its delivery, so its beats stop there too.
#[tokio::test]
async fn a_heartbeat_after_the_queue_visibility_ran_out_leaves_the_other_delivery_alone() {
    let (_moto, q) = started("q", one_second()).await;
    conformance_heartbeat_after_the_queue_visibility_ran_out(&q).await;
}

#[tokio::test]
async fn malformed_bodies_reach_dead_letters() {
    let moto = support::start();
    let (q, dlq) = with_dead_letters(&support::client(&moto).await).await;
    conformance_malformed_bodies_reach_dead_letters(&q, &dlq).await;
}

#[tokio::test]
async fn heartbeat_keeps_a_slow_message_invisible() {
    let (_moto, q) = started("q", one_second()).await;
    conformance_heartbeat_keeps_message_invisible(&q).await;
}

/// Runs `call`; asserts it fails with `Unavailable` from SQS within
/// `timeout` (plus scheduling slack), and at least `at_least` after its start.
///
/// The bound is a timer of the test's runtime, not a reading of the clock
/// once the call is over: the operation timeout is one of that runtime's
/// timers too (the SDK sleeps on Tokio), so a machine too busy to run the
/// runtime for a while makes both late alike, and the call, polled first,
/// ends at its own. A call still running past the bound (an operation
/// timeout longer than asked, retries outliving it) fails whatever the
/// machine's speed.
async fn assert_unavailable<T: std::fmt::Debug>(
    what: &str,
    call: impl Future<Output = pgonce::Result<T>>,
    timeout: Duration,
    at_least: Duration,
) {
    let started = Instant::now();
    // Twice the timeout: room for a loaded machine's scheduling, and still
    // short of a timeout applied to each of the default three attempts
    // (three times it, plus the backoff between them).
    let err = tokio::time::timeout(timeout * 2, call)
        .await
        .unwrap_or_else(|_| {
            panic!("{what}: still running at twice its operation timeout {timeout:?}")
        })
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(&err, Error::Unavailable { backend: "sqs", .. }),
        "{what}: {err:?}"
    );
    assert!(
        took >= at_least,
        "{what}: took {took:?}, operation timeout {timeout:?}"
    );
    eprintln!("{what}: {err} (after {took:?})");
}

/// `Queue` calls against a closed endpoint (the server is gone; nothing
/// listens on the port) fail with `Error::Unavailable` within the operation
/// timeout, retries included.
#[tokio::test]
async fn a_closed_endpoint_fails_typed_within_the_timeout() {
    let moto = support::start();
    let timeout = Duration::from_secs(2);
    let config = SqsConfig::local(moto.endpoint()).operation_timeout(timeout);
    let q = through(&moto, "q", QueueAttributes::default(), config).await;
    drop(moto); // stopped: the port is closed
    let send = q.send(SendMessage::new("x"));
    assert_unavailable("send, closed endpoint", send, timeout, Duration::ZERO).await;
    let receive = q.receive(ReceiveRequest::up_to(1));
    assert_unavailable("receive, closed endpoint", receive, timeout, Duration::ZERO).await;
}

/// A server that accepts connections and never answers: the call is cut
/// off by the operation timeout, not left hanging, with `Unavailable`.
#[tokio::test]
async fn a_silent_endpoint_fails_typed_at_the_timeout() {
    let silent = TcpListener::bind("127.0.0.1:0").unwrap(); // accepts, never reads
    let timeout = Duration::from_millis(1500);
    let config = SqsConfig::local(format!("http://{}", silent.local_addr().unwrap()))
        .operation_timeout(timeout);
    let sqs = SqsClient::connect(config).await.unwrap();
    let open = sqs.open("q");
    let at_least = timeout - Duration::from_millis(100);
    assert_unavailable("open, silent endpoint", open, timeout, at_least).await;
}

/// Bad input is a typed error and sends nothing; a missing queue is
/// `QueueNotFound`.
#[tokio::test]
async fn bad_input_is_rejected_before_any_request() {
    let moto = support::start();
    let sqs = support::client(&moto).await;
    let q = sqs
        .create_queue("q", QueueAttributes::default())
        .await
        .unwrap();
    for bad in [
        SendMessage::new(""),
        SendMessage::new("x").dedup("d"), // standard queues do not deduplicate
        SendMessage::new("x").group("g"),
        SendMessage::new("x").attribute("pgonce.id", "forged"),
        SendMessage::new("x").attribute("empty", ""),
    ] {
        assert!(
            matches!(q.send(bad.clone()).await, Err(Error::Invalid { .. })),
            "{bad:?}"
        );
    }
    let batch = vec![SendMessage::new("fine"), SendMessage::new("")];
    assert!(matches!(
        q.send_batch(batch).await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        q.send(SendMessage::new("x".repeat(300 * 1024))).await,
        Err(Error::MessageTooLarge { .. })
    ));
    assert_eq!(q.stats().await.unwrap().depth, 0, "nothing half-sent");
    assert!(matches!(
        sqs.create_queue("f", QueueAttributes::fifo()).await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        sqs.open("nope").await,
        Err(Error::QueueNotFound { name }) if name == "nope"
    ));
    let fifo = sqs
        .create_queue("f.fifo", QueueAttributes::fifo())
        .await
        .unwrap();
    assert!(matches!(
        fifo.send(
            SendMessage::new("x")
                .group("g")
                .delay(Duration::from_secs(1))
        )
        .await,
        Err(Error::Invalid { .. })
    ));
}

/// Batches over SQS's 10 per request go out in several requests, in order;
/// a deleted message's receipt is refused by moto only once moto has
/// forgotten it, so `delete_batch` reports no stale receipts here.
#[tokio::test]
async fn batches_larger_than_ten_round_trip() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    let sent = q
        .send_batch((0..25).map(|i| SendMessage::new(format!("{i}"))).collect())
        .await
        .unwrap();
    assert_eq!(sent.len(), 25);
    let mut got = Vec::new();
    while got.len() < 25 {
        let more = q
            .receive(ReceiveRequest::up_to(10).wait(Duration::from_secs(1)))
            .await
            .unwrap();
        assert!(!more.is_empty(), "only {} of 25", got.len());
        got.extend(more);
    }
    let receipts: Vec<_> = got.iter().map(|m| m.receipt.clone()).collect();
    assert!(q.delete_batch(&receipts).await.unwrap().is_empty());
    let s = q.stats().await.unwrap();
    assert_eq!((s.depth, s.in_flight), (0, 0));
}

/// The receipts of `n` messages sent to `q` and received.
async fn n_receipts(q: &SqsQueue, n: usize) -> Vec<Receipt> {
    q.send_batch((0..n).map(|i| SendMessage::new(format!("{i}"))).collect())
        .await
        .unwrap();
    let mut receipts = Vec::new();
    while receipts.len() < n {
        let more = q
            .receive(ReceiveRequest::up_to(10).wait(Duration::from_secs(1)))
            .await
            .unwrap();
        assert!(!more.is_empty(), "only {} of {n}", receipts.len());
        receipts.extend(more.into_iter().map(|m| m.receipt));
    }
    receipts
}

/// A fresh moto with queue "q", through a client that sends each request
/// once: the SDK retries a throttled request otherwise, and the faults the
/// tests ask moto for would fail every attempt.
async fn started_without_retries() -> (Moto, SqsQueue) {
    let moto = support::start();
    let config = SqsConfig {
        max_attempts: 1,
        ..SqsConfig::local(moto.endpoint())
    };
    let sqs = SqsClient::connect(config).await.unwrap();
    let q = sqs
        .create_queue("q", QueueAttributes::default())
        .await
        .unwrap();
    (moto, q)
}

/// Every message in `q` (received, and left to come back), in the order
/// of their bodies' numbers.
async fn everything(q: &SqsQueue) -> Vec<pgonce::Received> {
    let mut got = Vec::new();
    loop {
        let more = q
            .receive(ReceiveRequest::up_to(10).wait(Duration::from_secs(1)))
            .await
            .unwrap();
        if more.is_empty() {
            break;
        }
        got.extend(more);
    }
    got.sort_by_key(|m| m.body.parse::<usize>().unwrap_or(usize::MAX));
    got
}

fn bodies(messages: &[pgonce::Received]) -> Vec<String> {
    messages.iter().map(|m| m.body.clone()).collect()
}

/// What a `send_batch` that ended part way said.
struct Incomplete {
    sent: Vec<Option<pgonce::Sent>>,
    unsent: Vec<usize>,
    cause: Box<Error>,
}

/// Sends 25 messages with bodies "0" to "24" to `q` in one `send_batch`,
/// but for the one at 13, whose body asks moto for `fault`; what the call
/// said of it, or a panic naming `lost` when it did not say.
async fn send_25_failing_at_13(q: &SqsQueue, fault: &str, lost: &str) -> Incomplete {
    let body = |i: usize| if i == 13 { fault.into() } else { i.to_string() };
    let batch = (0..25).map(|i| SendMessage::new(body(i))).collect();
    match q.send_batch(batch).await {
        Err(Error::SendBatchIncomplete {
            sent,
            unsent,
            cause,
        }) => Incomplete {
            sent,
            unsent,
            cause,
        },
        other => panic!("{lost} go unreported: {other:?}"),
    }
}

/// A `send_batch` whose second request of 10 fails (moto refuses it whole,
/// as SQS a throttled request) says what it sent: the first request's 10,
/// with their ids, and as unsent the failed request's 10 and the 5 of the
/// request after it, not sent; the cause is the failed request's error.
/// Sending the unsent ones again is the remedy, without a duplicate on a
/// standard queue. (The failed request's error was returned alone: nothing
/// told the caller that 10 messages had been sent, nor their ids.)
#[tokio::test]
async fn a_send_batch_whose_request_fails_says_what_it_sent() {
    let (_moto, q) = started_without_retries().await;
    let Incomplete {
        sent,
        unsent,
        cause,
    } = send_25_failing_at_13(&q, Moto::FAIL_REQUEST, "the first request's sends").await;
    assert_eq!(sent.len(), 25, "one place per message");
    assert!(sent[..10].iter().all(Option::is_some), "{sent:?}");
    assert!(sent[10..].iter().all(Option::is_none), "{sent:?}");
    assert_eq!(unsent, (10..25).collect::<Vec<_>>());
    assert!(
        matches!(&*cause, Error::Backend { code, .. } if code == "RequestThrottled"),
        "{cause:?}"
    );
    let again: Vec<_> = unsent
        .iter()
        .map(|i| SendMessage::new(i.to_string()))
        .collect();
    q.send_batch(again).await.unwrap();
    let there = everything(&q).await;
    let want: Vec<String> = (0..25).map(|i| i.to_string()).collect();
    assert_eq!(bodies(&there), want, "each message once");
    let ids = |ms: &[pgonce::Received]| ms.iter().map(|m| m.id.clone()).collect::<Vec<_>>();
    let sent_ids: Vec<String> = sent[..10].iter().flatten().map(|s| s.id.clone()).collect();
    assert_eq!(sent_ids, ids(&there[..10]), "the ids of what was sent");
}

/// A `send_batch` whose second request SQS takes in part (moto refuses one
/// entry) names the entry as unsent and every other of that request as
/// sent, and sends no further request: the request after it is unsent
/// too, so that a FIFO group's later messages never go ahead of one that
/// is to be sent again. The cause is the refused entry's error.
#[tokio::test]
async fn a_send_batch_whose_entry_is_refused_says_what_it_sent() {
    let (_moto, q) = started_without_retries().await;
    let Incomplete {
        sent,
        unsent,
        cause,
    } = send_25_failing_at_13(&q, Moto::FAIL_ENTRY, "the requests' sends").await;
    let sent_at: Vec<usize> = (0..25).filter(|&i| sent[i].is_some()).collect();
    let want: Vec<usize> = (0..20).filter(|&i| i != 13).collect();
    assert_eq!(sent_at, want);
    assert_eq!(unsent, [13, 20, 21, 22, 23, 24]);
    assert!(
        matches!(&*cause, Error::Backend { code, .. } if code == "KMS.ThrottlingException"),
        "{cause:?}"
    );
    let want: Vec<String> = want.iter().map(|i| i.to_string()).collect();
    assert_eq!(
        bodies(&everything(&q).await),
        want,
        "what it named as sent, once each"
    );
}

/// A `delete_batch` whose second request of 10 fails (moto refuses it
/// whole, as SQS a throttled request) says what it did: the first
/// request's 10 deleted (not named), a receipt of another queue stale, the
/// failed request's receipts and those of the request after it, not sent,
/// undone; the cause is the failed request's error. Deleting the undone
/// ones again is the remedy. (The failed request's error was returned
/// alone: nothing told the caller that the first request had deleted 10
/// messages, nor which receipts were still to delete.)
#[tokio::test]
async fn a_delete_batch_that_fails_part_way_says_what_it_deleted() {
    let (_moto, q) = started_without_retries().await;
    let receipts = n_receipts(&q, 25).await;
    let fails = Receipt(format!("q:{}", support::Moto::FAIL_REQUEST));
    let foreign = Receipt("other:handle".into());
    let mut batch = receipts[..10].to_vec();
    batch.push(fails.clone());
    batch.extend_from_slice(&receipts[10..]);
    batch.push(foreign.clone());
    let got = q.delete_batch(&batch).await;
    let Err(Error::DeleteBatchIncomplete {
        stale,
        undone,
        cause,
    }) = got
    else {
        panic!("the first request's deletes go unreported: {got:?}")
    };
    assert_eq!(stale, [foreign], "the other queue's receipt");
    assert_eq!(undone, batch[10..26], "the failed request's and the rest");
    assert!(
        matches!(&*cause, Error::Backend { code, .. } if code == "RequestThrottled"),
        "{cause:?}"
    );
    let s = q.stats().await.unwrap();
    assert_eq!((s.depth, s.in_flight), (0, 15), "the first 10 deleted");
    assert!(q.delete_batch(&undone[1..]).await.unwrap().is_empty());
    let s = q.stats().await.unwrap();
    assert_eq!((s.depth, s.in_flight), (0, 0), "the rest deleted again");
}

/// A receipt given twice in one `delete_batch` deletes its message once
/// and is not stale in either place, as on the PostgreSQL queue. (Both
/// went in one request, which SQS and moto refuse whole,
/// `BatchEntryIdsNotDistinct`: nothing deleted, a `Backend` error.)
#[tokio::test]
async fn a_receipt_given_twice_in_a_delete_batch_deletes_once() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    let receipts = n_receipts(&q, 2).await;
    let batch = [
        receipts[0].clone(),
        receipts[1].clone(),
        receipts[0].clone(),
    ];
    let got = q.delete_batch(&batch).await;
    assert!(matches!(&got, Ok(stale) if stale.is_empty()), "{got:?}");
    let s = q.stats().await.unwrap();
    assert_eq!((s.depth, s.in_flight), (0, 0), "both deleted");
}

/// A FIFO group with a backlog deeper than `max_receive_count`, consumed in
/// batches of ten by a consumer that deletes every message it is handed:
/// every message reaches the consumer once and none is dead-lettered. SQS
/// hands out several messages of one group in a batch and counts each as
/// received; a backend that released the ones it cannot hand out (one per
/// group in flight) had SQS count those releases, and moved the group's
/// later messages to the dead-letter queue before anyone saw them.
#[tokio::test]
async fn a_deep_fifo_group_is_handed_out_whole_without_dead_letters() {
    let moto = support::start();
    let sqs = support::client(&moto).await;
    let (q, dlq) = dead_lettered(&sqs, "deep.fifo", "deep-dlq.fifo", QueueAttributes::fifo()).await;
    let mut sent = Vec::new();
    for i in 0..24 {
        // Two groups, the first three times as deep as the second.
        let group = if i % 4 == 3 { "shallow" } else { "deep" };
        let body = format!("{group}-{i}");
        q.send(SendMessage::new(&body).group(group).dedup(&body))
            .await
            .unwrap();
        sent.push(body);
    }
    let mut handed = Vec::new();
    // Bounded by receives, not time: every receive that finds the queue
    // non-empty hands out at least one message.
    for _ in 0..200 {
        if handed.len() == sent.len() {
            break;
        }
        let got = q
            .receive(ReceiveRequest::up_to(10).wait(Duration::from_secs(1)))
            .await
            .unwrap();
        for m in got {
            handed.push(m.body.clone());
            q.delete(&m.receipt).await.unwrap();
        }
    }
    let dead = dlq.stats().await.unwrap().depth;
    assert_eq!(dead, 0, "dead-lettered unseen; handed out: {handed:?}");
    let order = |group: &str| -> Vec<String> {
        let prefix = format!("{group}-");
        handed
            .iter()
            .filter(|b| b.starts_with(&prefix))
            .cloned()
            .collect()
    };
    let expected = |group: &str| -> Vec<String> {
        let prefix = format!("{group}-");
        sent.iter()
            .filter(|b| b.starts_with(&prefix))
            .cloned()
            .collect()
    };
    assert_eq!(order("deep"), expected("deep"), "each once, in order");
    assert_eq!(order("shallow"), expected("shallow"), "each once, in order");
}

/// A FIFO receive with a visibility of zero hands its message out and
/// leaves it visible at once. Each such receive is one receive of the
/// message, as SQS counts toward `max_receive_count`: a consumer that
/// receives it `max_receive_count` times sees it each time, and only the
/// receive after that moves it to the dead-letter queue. (Topping the batch
/// up received the same head again, uncounted by the consumer but counted
/// by SQS, so it was dead-lettered after half as many receives.)
#[tokio::test]
async fn a_fifo_receive_with_zero_visibility_counts_one_receive() {
    let moto = support::start();
    let sqs = support::client(&moto).await;
    let (q, dlq) = dead_lettered(&sqs, "zero.fifo", "zero-dlq.fifo", QueueAttributes::fifo()).await;
    q.send(SendMessage::new("m").group("g").dedup("m"))
        .await
        .unwrap();
    // max_receive_count is 2: two receives hand the message out.
    for expected in 1..=2 {
        let got = q
            .receive(ReceiveRequest::up_to(10).visibility(Duration::ZERO))
            .await
            .unwrap();
        let counts: Vec<u32> = got.iter().map(|m| m.receive_count).collect();
        assert_eq!(counts, [expected], "receive {expected}");
    }
    assert_eq!(dlq.stats().await.unwrap().depth, 0, "not dead-lettered yet");
}

/// The same with the queue's own visibility timeout of zero and none given
/// per receive.
#[tokio::test]
async fn a_fifo_queue_with_zero_visibility_counts_one_receive_per_receive() {
    let moto = support::start();
    let sqs = support::client(&moto).await;
    let attributes = QueueAttributes::fifo().visibility_timeout(Duration::ZERO);
    let (q, dlq) = dead_lettered(&sqs, "zero.fifo", "zero-dlq.fifo", attributes).await;
    q.send(SendMessage::new("m").group("g").dedup("m"))
        .await
        .unwrap();
    for expected in 1..=2 {
        let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
        let counts: Vec<u32> = got.iter().map(|m| m.receive_count).collect();
        assert_eq!(counts, [expected], "receive {expected}");
    }
    assert_eq!(dlq.stats().await.unwrap().depth, 0, "not dead-lettered yet");
}

/// What SQS refuses (or, for a body, may store altered: characters outside
/// XML's set replaced by U+FFFD) is refused before any request, typed
/// `Invalid`, and a batch holding one such message sends none of it. One
/// of SQS's 10 message attributes is kept for the pgonce id a redrive
/// carries, so a message with 10 would be sent and never redriven.
#[tokio::test]
async fn what_sqs_would_refuse_or_alter_is_refused_before_sending() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    let ten = (0..10).fold(SendMessage::new("x"), |m, i| {
        m.attribute(format!("a{i}"), "v")
    });
    for bad in [
        SendMessage::new("control \u{1} character"),
        SendMessage::new("noncharacter \u{FFFE}"),
        SendMessage::new("x").attribute("k", "control \u{1b}"),
        SendMessage::new("x").attribute("has space", "v"),
        SendMessage::new("x").attribute("AWS.reserved", "v"),
        SendMessage::new("x").attribute("amazon.reserved", "v"),
        SendMessage::new("x").attribute(".leading", "v"),
        SendMessage::new("x").attribute("trailing.", "v"),
        SendMessage::new("x").attribute("two..periods", "v"),
        SendMessage::new("x").attribute("n".repeat(257), "v"),
        ten,
    ] {
        let what = format!("{:?}", bad.attributes.keys().collect::<Vec<_>>());
        assert!(
            matches!(q.send(bad.clone()).await, Err(Error::Invalid { .. })),
            "send {:?} {what}",
            bad.body
        );
        let batch = vec![SendMessage::new("fine"), bad];
        assert!(
            matches!(q.send_batch(batch).await, Err(Error::Invalid { .. })),
            "batch {what}"
        );
    }
    assert_eq!(q.stats().await.unwrap().depth, 0, "nothing sent");
    // Group and deduplication ids are ASCII letters, digits and punctuation.
    let fifo = support::client(&_moto)
        .await
        .create_queue("f.fifo", QueueAttributes::fifo())
        .await
        .unwrap();
    for bad in [
        SendMessage::new("x").group("with space").dedup("d"),
        SendMessage::new("x").group("é").dedup("d"),
        SendMessage::new("x").group("g").dedup("with space"),
        SendMessage::new("x").group("g").dedup("✓"),
    ] {
        let good = SendMessage::new("fine").group("g").dedup("fine");
        assert!(
            matches!(fifo.send(bad.clone()).await, Err(Error::Invalid { .. })),
            "{bad:?}"
        );
        assert!(
            matches!(
                fifo.send_batch(vec![good, bad.clone()]).await,
                Err(Error::Invalid { .. })
            ),
            "batch {bad:?}"
        );
    }
    assert_eq!(fifo.stats().await.unwrap().depth, 0, "nothing sent");
    fifo.send(SendMessage::new("x").group("g!~#").dedup("a:b/c"))
        .await
        .unwrap();
    // What SQS takes round-trips unchanged.
    let nine = (0..9).fold(
        SendMessage::new("tab\t cr\r lf\n é ✓ 𝄞 \u{D7FF}\u{E000}\u{FFFD}\u{10FFFF}"),
        |m, i| m.attribute(format!("a.b-c_{i}"), "ü ✓"),
    );
    q.send(nine.clone()).await.unwrap();
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body, nine.body);
    assert_eq!(got[0].attributes, nine.attributes);
}

/// The one message in `q`, as SQS hands it out (all its attributes and
/// system attributes), received with the SDK; panics on none or more.
async fn the_one_message(sqs: &SqsClient, q: &SqsQueue) -> aws_sdk_sqs::types::Message {
    let out = sqs
        .sdk()
        .receive_message()
        .queue_url(q.url())
        .max_number_of_messages(10)
        .message_attribute_names("All")
        .message_system_attribute_names(aws_sdk_sqs::types::MessageSystemAttributeName::All)
        .send()
        .await
        .unwrap();
    let [m] = out.messages() else {
        panic!("one message back: {:?}", out.messages())
    };
    m.clone()
}

/// A redrive moves a message back as it is, whoever sent it: attributes of
/// SQS's Number and Binary types (a producer outside pgonce may send them)
/// keep their type and value, beside the `pgonce.id` the redrive adds.
/// (The redrive re-sent every attribute as a String of its string value, so
/// a Number became a String and a Binary an empty String, which SQS
/// refuses: the redrive failed at that message.)
#[tokio::test]
async fn redrive_keeps_attribute_types() {
    use aws_sdk_sqs::primitives::Blob;
    use aws_sdk_sqs::types::MessageAttributeValue;
    let moto = support::start();
    let sqs = support::client(&moto).await;
    let (q, dlq) = with_dead_letters(&sqs).await;
    let value = |data_type: &str| MessageAttributeValue::builder().data_type(data_type);
    let attributes = [
        ("n", value("Number").string_value("42").build().unwrap()),
        (
            "b",
            value("Binary")
                .binary_value(Blob::new(vec![0u8, 1, 255]))
                .build()
                .unwrap(),
        ),
        ("s", value("String").string_value("x").build().unwrap()),
    ];
    sqs.sdk()
        .send_message()
        .queue_url(dlq.url())
        .message_body("from elsewhere")
        .set_message_attributes(Some(
            attributes
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    let m = the_one_message(&sqs, &q).await;
    let got = m.message_attributes().unwrap();
    for (name, sent) in &attributes {
        assert_eq!(got.get(*name), Some(sent), "{name}: {got:?}");
    }
    assert!(got.contains_key("pgonce.id"), "{got:?}");
}

/// SQS counts a message's attributes (name, data type and value) toward its
/// 256 KiB, and a queue's `MaximumMessageSize` may be lower: a message over
/// either is refused with `MessageTooLarge` before any request, by `send`
/// and `send_batch` alike, and nothing is sent. Room is kept for the
/// `pgonce.id` attribute a redrive adds: 51 bytes (its name, `String`, a
/// 36-character message id). (A body within 256 KiB was sent whatever its
/// attributes, and a queue's lower limit was not read: moto took the first
/// and refused the second with a `Backend` error; SQS refuses both.)
#[tokio::test]
async fn a_message_over_sqs_size_limit_is_refused_before_sending() {
    use aws_sdk_sqs::types::QueueAttributeName;
    let (moto, q) = started("q", QueueAttributes::default()).await;
    let sqs = support::client(&moto).await;
    let max = 262_144 - 51;
    let attribute = "k".len() + "String".len() + 100;
    let sized = |bytes: usize| {
        SendMessage::new("x".repeat(bytes - attribute)).attribute("k", "v".repeat(100))
    };
    let too_large = |r: &pgonce::Result<()>| matches!(r, Err(Error::MessageTooLarge { size, max: m }) if *size == max + 1 && *m == max);
    let sent = q.send(sized(max + 1)).await.map(|_| ());
    assert!(too_large(&sent), "send: {sent:?}");
    let batch = vec![SendMessage::new("fine"), sized(max + 1)];
    let sent = q.send_batch(batch).await.map(|_| ());
    assert!(too_large(&sent), "batch: {sent:?}");
    assert_eq!(q.stats().await.unwrap().depth, 0, "nothing sent");
    q.send(sized(max)).await.unwrap();

    sqs.sdk()
        .create_queue()
        .queue_name("small")
        .attributes(QueueAttributeName::MaximumMessageSize, "1024")
        .send()
        .await
        .unwrap();
    let small = sqs.open("small").await.unwrap();
    let sent = small.send(SendMessage::new("x".repeat(1000))).await;
    assert!(
        matches!(
            sent,
            Err(Error::MessageTooLarge {
                size: 1000,
                max: 973
            })
        ),
        "{sent:?}"
    );
    assert_eq!(small.stats().await.unwrap().depth, 0, "nothing sent");
    small.send(SendMessage::new("x".repeat(973))).await.unwrap();
    let sent = small
        .send_batch(vec![SendMessage::new("y".repeat(600)); 3])
        .await
        .unwrap();
    assert_eq!(sent.len(), 3, "each in a request of its own");
}

/// Attributes of SQS's other types, sent by a producer outside pgonce,
/// read back through the trait's string map: a Number's value as sent, a
/// Binary's bytes (of any custom label) as their standard base64, which
/// decodes to them. (A Binary attribute read back as an empty string.)
#[tokio::test]
async fn binary_attributes_read_back_as_the_base64_of_their_bytes() {
    use aws_sdk_sqs::primitives::Blob;
    use aws_sdk_sqs::types::MessageAttributeValue;
    let (moto, q) = started("q", QueueAttributes::default()).await;
    let value = |data_type: &str| MessageAttributeValue::builder().data_type(data_type);
    let binary = |data_type: &str, bytes: &[u8]| {
        value(data_type)
            .binary_value(Blob::new(bytes.to_vec()))
            .build()
            .unwrap()
    };
    let sqs = support::client(&moto).await;
    sqs.sdk()
        .send_message()
        .queue_url(q.url())
        .message_body("from elsewhere")
        .message_attributes("b", binary("Binary", &[0, 1, 255]))
        .message_attributes("g", binary("Binary.gzip", &[31, 139]))
        .message_attributes("n", value("Number").string_value("42").build().unwrap())
        .message_attributes("s", value("String").string_value("x").build().unwrap())
        .send()
        .await
        .unwrap();
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    let [m] = &got[..] else {
        panic!("one message: {got:?}")
    };
    let read: Vec<(&str, &str)> = m
        .attributes
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        read,
        [("b", "AAH/"), ("g", "H4s="), ("n", "42"), ("s", "x")]
    );
    let decoded = aws_smithy_types::base64::decode(&m.attributes["b"]).unwrap();
    assert_eq!(decoded, [0, 1, 255]);
}

/// A standard queue's message may carry a group: SQS's fair queues, from a
/// producer outside pgonce (pgonce sends none on a standard queue). It is
/// reported, orders nothing (a receive hands out several messages of one
/// group at once, as a standard queue does), and a redrive keeps it.
/// (A redrive dropped it, so the message lost its place in its tenant's
/// fair share.)
#[tokio::test]
async fn a_standard_queues_message_group_is_reported_unordered_and_redriven() {
    let moto = support::start();
    let sqs = support::client(&moto).await;
    let (q, dlq) = with_dead_letters(&sqs).await;
    for (url, body, group) in [
        (q.url(), "a1", "tenant-a"),
        (q.url(), "a2", "tenant-a"),
        (dlq.url(), "b1", "tenant-b"),
    ] {
        sqs.sdk()
            .send_message()
            .queue_url(url)
            .message_body(body)
            .message_group_id(group)
            .send()
            .await
            .unwrap();
    }
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    let mut seen: Vec<(&str, Option<&str>)> = got
        .iter()
        .map(|m| (m.body.as_str(), m.group_id.as_deref()))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [("a1", Some("tenant-a")), ("a2", Some("tenant-a"))],
        "both of the group at once"
    );
    for m in &got {
        q.delete(&m.receipt).await.unwrap();
    }
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    let got = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    let seen: Vec<(&str, Option<&str>)> = got
        .iter()
        .map(|m| (m.body.as_str(), m.group_id.as_deref()))
        .collect();
    assert_eq!(seen, [("b1", Some("tenant-b"))]);
}

/// A redrive to a FIFO queue re-sends each message with the dead-letter
/// message's id as its deduplication id, the same on every redrive of it,
/// so a redrive run again after one that failed between a re-send and its
/// delete does not send that message twice within SQS's window. (Each
/// re-send had a fresh deduplication id.)
#[tokio::test]
async fn a_fifo_redrive_deduplicates_by_the_dead_letter_message_id() {
    use aws_sdk_sqs::types::MessageSystemAttributeName;
    let moto = support::start();
    let sqs = support::client(&moto).await;
    let (q, dlq) = dead_lettered(&sqs, "r.fifo", "r-dlq.fifo", QueueAttributes::fifo()).await;
    let sent = dlq
        .send(SendMessage::new("m").group("g").dedup("m"))
        .await
        .unwrap();
    assert_eq!(dlq.redrive().await.unwrap(), 1);
    let m = the_one_message(&sqs, &q).await;
    let dedup = m
        .attributes()
        .and_then(|a| a.get(&MessageSystemAttributeName::MessageDeduplicationId));
    assert_eq!(dedup, Some(&sent.id));
}

/// What `q.change_visibility`, `q.delete` and `q.delete_batch` made of
/// `receipt`, each as `Ok` or the error's variant name.
async fn outcomes(q: &SqsQueue, receipt: &Receipt) -> Vec<String> {
    let kind = |r: pgonce::Result<()>| match r {
        Ok(()) => "Ok".to_string(),
        Err(Error::StaleReceipt { .. }) => "StaleReceipt".to_string(),
        Err(e) => format!("{e:?}"),
    };
    let hidden = q.change_visibility(receipt, Duration::from_secs(600)).await;
    let deleted = q.delete(receipt).await;
    let batch = q.delete_batch(std::slice::from_ref(receipt)).await;
    let batch = match batch {
        Ok(stale) if stale == [receipt.clone()] => "reported stale".to_string(),
        other => format!("{other:?}"),
    };
    vec![kind(hidden), kind(deleted), batch]
}

/// A receipt is good in the queue that issued it only: the source queue's
/// last receipt of a message, presented to the dead-letter queue the
/// message moved to, hides and deletes nothing there and is stale; and the
/// dead-letter queue's receipt of it is stale in the source queue. The
/// message stays in the dead-letter queue, visible. (SQS's handle went to
/// the dead-letter queue's URL as it was; moto, which keeps a message's
/// handles across the move, hid the dead-lettered copy and deleted it.)
#[tokio::test]
async fn a_receipt_from_another_queue_touches_nothing() {
    let moto = support::start();
    let (q, dlq) = with_dead_letters(&support::client(&moto).await).await;
    q.send(SendMessage::new("poison")).await.unwrap();
    let mut last = None;
    for _ in 0..2 {
        let got = q
            .receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(5)))
            .await
            .unwrap();
        q.change_visibility(&got[0].receipt, Duration::ZERO)
            .await
            .unwrap();
        last = Some(got[0].receipt.clone());
    }
    let last = last.unwrap();
    let none = q
        .receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(1)))
        .await
        .unwrap();
    assert!(none.is_empty(), "moved to the dead-letter queue: {none:?}");
    assert_eq!(dlq.stats().await.unwrap().depth, 1);

    let refused = ["StaleReceipt", "StaleReceipt", "reported stale"];
    assert_eq!(
        outcomes(&dlq, &last).await,
        refused,
        "source receipt in the DLQ"
    );
    let s = dlq.stats().await.unwrap();
    assert_eq!((s.depth, s.in_flight), (1, 0), "still there, visible");

    let dead = dlq.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(dead.len(), 1, "the dead letter is receivable");
    assert_eq!(
        outcomes(&q, &dead[0].receipt).await,
        refused,
        "DLQ receipt in the source"
    );
    assert_eq!(dlq.stats().await.unwrap().in_flight, 1, "still in flight");
    // In a batch, each receipt on its own, stale ones in input order.
    let garbage = Receipt("not a receipt".into());
    let batch = [last.clone(), dead[0].receipt.clone(), garbage.clone()];
    assert_eq!(dlq.delete_batch(&batch).await.unwrap(), [last, garbage]);
    let s = dlq.stats().await.unwrap();
    assert_eq!((s.depth, s.in_flight), (0, 0), "its own receipt deleted it");
}

/// A receive told to stop ends between its long polls: with a wait of 60 s
/// and a stop raised while its first 20 s poll is under way, it finishes
/// that poll and sends no other. A poll under way when the stop comes is
/// not cut short: the message it delivers is returned. (The default
/// `receive_or_stop` finished the receive whatever the stop said: three
/// polls, 60 s.)
#[tokio::test]
async fn a_stop_ends_a_long_receive_after_the_poll_under_way() {
    let (_moto, q) = started("q", QueueAttributes::default()).await;
    let long = ReceiveRequest::up_to(1).wait(Duration::from_secs(60));
    // Raises the stop once the receive's `polls`-th request has begun,
    // then (when `send`) sends a message for that request to deliver.
    let stop_at = |polls: u64, send: bool| {
        let (raise, raised) = tokio::sync::oneshot::channel::<()>();
        let q = q.clone();
        let driver = async move {
            wait_until("the receive's request begun", || async {
                q.receive_requests() >= polls
            })
            .await;
            // (The default `receive_or_stop` drops its stop at once.)
            let _ = raise.send(());
            if send {
                q.send(SendMessage::new("late")).await.unwrap();
            }
        };
        let stop = async move {
            let _ = raised.await;
        };
        (driver, stop)
    };

    let (driver, stop) = stop_at(1, false);
    let (got, ()) = tokio::join!(q.receive_or_stop(long, stop), driver);
    assert_eq!(
        (got.unwrap(), q.receive_requests()),
        (Vec::new(), 1),
        "nothing delivered, no poll after the stop"
    );

    let (driver, stop) = stop_at(2, true);
    let (got, ()) = tokio::join!(q.receive_or_stop(long, stop), driver);
    let bodies: Vec<String> = got.unwrap().into_iter().map(|m| m.body).collect();
    assert_eq!(
        (bodies, q.receive_requests()),
        (vec!["late".to_string()], 2),
        "the poll under way delivers"
    );
}

/// A receive told to stop before it begins sends no request and returns
/// none; a FIFO receive told to stop once its first request is made is not
/// topped up: the message that request delivered is returned and no
/// further request is sent. (The default `receive_or_stop` topped the
/// batch up, one request per group and one more that found none.)
#[tokio::test]
async fn a_receive_stopped_before_it_begins_asks_for_nothing_and_one_stopped_after_is_not_topped_up()
 {
    let (_moto, q) = started("f.fifo", QueueAttributes::fifo()).await;
    for group in ["a", "b", "c"] {
        q.send(SendMessage::new(group).group(group)).await.unwrap();
    }
    let request = || ReceiveRequest::up_to(10).wait(Duration::from_secs(60));
    let got = q
        .receive_or_stop(request(), std::future::ready(()))
        .await
        .unwrap();
    assert_eq!(
        (got.len(), q.receive_requests()),
        (0, 0),
        "stopped before it began: no request"
    );
    // Raised as soon as the first request has been sent.
    let after_the_first = std::future::poll_fn(|_| {
        if q.receive_requests() >= 1 {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    });
    let got = q.receive_or_stop(request(), after_the_first).await.unwrap();
    let bodies: Vec<String> = got.into_iter().map(|m| m.body).collect();
    assert_eq!(
        (bodies, q.receive_requests()),
        (vec!["a".to_string()], 1),
        "one request, one group's head"
    );
}

/// Whole seconds of `left`, rounded down: a receive that waits this long
/// asks SQS for a wait that ends before `left` does (the backend sends
/// waits rounded up).
fn whole_seconds_within(left: Duration) -> Duration {
    Duration::from_secs(left.as_secs())
}

/// A delivery states the visibility SQS gave it, however the queue's
/// `VisibilityTimeout` was changed after the handle was opened: the
/// message is not delivered again before `requested_at + visibility`, and
/// is after it. Both ways: a timeout shortened (3 s to 1 s), where a
/// longer stated end is the dangerous side (a worker beats on, and
/// believes it holds, a message SQS already delivered again), and one
/// lengthened (1 s to 30 s), where the message stays hidden past the
/// stated end. (The handle stated the timeout it read when it was opened
/// and let SQS apply the queue's current one: 3 s stated and redelivered
/// after 1 s; 1 s stated and hidden for 30 s.)
#[tokio::test]
async fn a_delivery_states_the_visibility_sqs_gave_it_after_the_queue_timeout_changed() {
    use aws_sdk_sqs::types::QueueAttributeName;
    for (opened, changed_to) in [(1, 30)] {
        let attributes = QueueAttributes::default().visibility_timeout(Duration::from_secs(opened));
        let (moto, q) = started("q", attributes).await;
        support::client(&moto)
            .await
            .sdk()
            .set_queue_attributes()
            .queue_url(q.url())
            .attributes(
                QueueAttributeName::VisibilityTimeout,
                changed_to.to_string(),
            )
            .send()
            .await
            .unwrap();
        q.send(SendMessage::new("m")).await.unwrap();
        let first = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
        let [first] = &first[..] else {
            panic!("one delivery: {first:?}")
        };
        let stated = first.visibility.expect("SQS deliveries state a visibility");
        let ends = first.requested_at + stated;
        let case = format!("opened at {opened} s, changed to {changed_to} s, stated {stated:?}");
        // Polls that end before the stated end find nothing: SQS hides the
        // message from some time after `requested_at` for as long as it
        // gave it, so one found while the stated end is still ahead was
        // hidden for less than stated.
        loop {
            let wait = whole_seconds_within(ends.saturating_duration_since(Instant::now()));
            if wait.is_zero() {
                break;
            }
            let got = q
                .receive(ReceiveRequest::up_to(1).wait(wait))
                .await
                .unwrap();
            assert!(
                got.is_empty() || Instant::now() >= ends,
                "{case}: delivered again before the end its first delivery stated"
            );
            if !got.is_empty() {
                break;
            }
        }
        // After it, the message is there to take (a poll waits for it).
        let wait = Duration::from_secs(20);
        let again = q
            .receive(ReceiveRequest::up_to(1).wait(wait))
            .await
            .unwrap();
        let counts: Vec<u32> = again.iter().map(|m| m.receive_count).collect();
        assert_eq!(
            counts,
            [2],
            "{case}: not delivered again within {wait:?} of the end its first delivery stated"
        );
    }
}

/// Queue `name`, created as `attributes` through moto itself, opened
/// through a client of `config` (one of a front to moto).
async fn through(
    moto: &Moto,
    name: &str,
    attributes: QueueAttributes,
    config: SqsConfig,
) -> SqsQueue {
    support::client(moto)
        .await
        .create_queue(name, attributes)
        .await
        .unwrap();
    let sqs = SqsClient::connect(config).await.unwrap();
    // The open goes through the short operation timeout the tests are
    // about, and a busy machine can make moto answer its four requests
    // later than that: set-up is not what they check, so an open cut off
    // by the timeout is tried again.
    let mut tries = 0;
    loop {
        match sqs.open(name).await {
            Ok(q) => return q,
            Err(Error::Unavailable { .. }) if tries < 20 => tries += 1,
            Err(e) => panic!("opening {name}: {e:?}"),
        }
    }
}

/// A fresh moto, a front to it, and queue `name` opened through the front.
async fn fronted(name: &str, attributes: QueueAttributes) -> (Moto, support::Front, SqsQueue) {
    let moto = support::start();
    let front = support::Front::start(&moto).await;
    let config = SqsConfig::local(front.endpoint());
    let q = through(&moto, name, attributes, config).await;
    (moto, front, q)
}

/// A send to a standard queue whose request SQS took but whose answer was
/// lost (the connection dropped) is not sent again by the SDK: the call
/// fails `Unavailable` (a batch: `SendBatchIncomplete`, every message
/// unsent, that cause), and each message is in the queue once. A standard
/// queue cannot drop a second copy, so a blind resend is a duplicate.
/// Nor is one answered with a server error (5xx), which says not whether
/// SQS acted. One SQS refused (throttled, 4xx) is sent again, and goes
/// through. (The SDK retried the request whose answer was lost, a
/// transient error to it, and the call succeeded with every message in
/// the queue twice.)
#[tokio::test]
async fn a_standard_send_whose_answer_is_lost_is_not_sent_again() {
    let (_moto, front, q) = fronted("q", QueueAttributes::default()).await;

    front.fail("SendMessageBatch", support::Fault::AnswerLost, 1);
    let batch = (0..3).map(|i| SendMessage::new(i.to_string())).collect();
    let got = q.send_batch(batch).await;
    let Err(Error::SendBatchIncomplete {
        sent,
        unsent,
        cause,
    }) = &got
    else {
        panic!("the lost answer goes unreported: {got:?}")
    };
    assert_eq!((sent.len(), &unsent[..]), (3, &[0, 1, 2][..]), "{got:?}");
    assert!(matches!(**cause, Error::Unavailable { .. }), "{cause:?}");
    assert_eq!(front.requests("SendMessageBatch"), 1, "sent once");

    front.fail("SendMessage", support::Fault::AnswerLost, 1);
    let got = q.send(SendMessage::new("3")).await;
    assert!(matches!(got, Err(Error::Unavailable { .. })), "{got:?}");
    assert_eq!(front.requests("SendMessage"), 1, "sent once");

    front.fail("SendMessage", support::Fault::Refused, 1);
    let got = q.send(SendMessage::new("refused")).await;
    assert!(
        matches!(&got, Err(Error::Backend { code, .. }) if code == "ServiceUnavailable"),
        "{got:?}"
    );
    assert_eq!(front.requests("SendMessage"), 2, "not sent again");

    front.fail("SendMessage", support::Fault::Throttled, 1);
    q.send(SendMessage::new("4")).await.unwrap();
    assert_eq!(front.requests("SendMessage"), 4, "throttled, then sent");

    let want: Vec<String> = (0..5).map(|i| i.to_string()).collect();
    assert_eq!(bodies(&everything(&q).await), want, "each message once");
}

/// On a FIFO queue the SDK's retry of a request whose answer was lost is
/// harmless: every message goes with a deduplication id (the caller's, a
/// fresh one per call, or the body's with content-based deduplication),
/// the same on the retry, and SQS drops the second copy. The call
/// succeeds; each message is in the queue once.
#[tokio::test]
async fn a_fifo_send_whose_answer_is_lost_is_sent_again_without_a_duplicate() {
    let (_moto, front, q) = fronted("f.fifo", QueueAttributes::fifo()).await;
    front.fail("SendMessageBatch", support::Fault::AnswerLost, 1);
    let batch = (0..3)
        .map(|i| SendMessage::new(i.to_string()).group(i.to_string()))
        .collect();
    q.send_batch(batch).await.unwrap();
    assert_eq!(front.requests("SendMessageBatch"), 2, "sent again once");
    let want: Vec<String> = (0..3).map(|i| i.to_string()).collect();
    assert_eq!(bodies(&everything(&q).await), want, "each message once");
}

/// A send to a standard queue that SQS took but did not answer within the
/// operation timeout fails `Unavailable` at the timeout, not sent again:
/// the SDK's retries run within that timeout, which ends them all. The
/// message is in the queue once; the error says it may be.
#[tokio::test]
async fn a_standard_send_cut_off_by_its_timeout_fails_typed_and_is_not_sent_again() {
    let moto = support::start();
    let front = support::Front::start(&moto).await;
    let timeout = Duration::from_secs(1);
    let config = SqsConfig::local(front.endpoint()).operation_timeout(timeout);
    let q = through(&moto, "q", QueueAttributes::default(), config).await;
    front.fail("SendMessage", support::Fault::AnswerWithheld, 1);
    let send = q.send(SendMessage::new("0"));
    assert_unavailable("send, answer withheld", send, timeout, Duration::ZERO).await;
    assert_eq!(front.requests("SendMessage"), 1, "sent once");
    assert_eq!(bodies(&everything(&q).await), ["0"], "in the queue once");
}

/// A delivery made by the SDK's retry of a ReceiveMessage is counted from
/// when that retry went out, not from the first attempt: its
/// `requested_at` is after the first attempt was refused (503, SQS took
/// nothing). Counted from the first, a delivery looks run out the first
/// attempt and the SDK's backoff before it does. (It was the start of the
/// whole call, before the first attempt.)
#[tokio::test]
async fn a_delivery_by_a_retried_receive_is_counted_from_the_retry() {
    let (_moto, front, q) = fronted("q", QueueAttributes::default()).await;
    q.send(SendMessage::new("m")).await.unwrap();
    front.fail("ReceiveMessage", support::Fault::Refused, 1);
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(front.requests("ReceiveMessage"), 2, "refused, then retried");
    let [m] = &got[..] else {
        panic!("one delivery: {got:?}")
    };
    let refused_at = front.faulted_at().expect("the first attempt refused");
    assert!(
        m.requested_at >= refused_at,
        "counted from {:?} before the first attempt was refused",
        refused_at - m.requested_at
    );
}

/// Every call on a queue deleted after its handle was opened is
/// `QueueNotFound` naming the queue, as `open` names it; a batch says it
/// as its cause. So is a receive under way when it went (seen in flight,
/// then the queue deleted), whose wait outlasts one long poll: moto
/// answers the poll under way with no message at its end (20 s), and the
/// next one says the queue is gone. (They named SQS's message instead:
/// `queue "The specified queue does not exist." does not exist`.)
#[tokio::test]
async fn calls_on_a_queue_deleted_after_the_open_name_it() {
    let moto = support::start();
    let sqs = support::client(&moto).await;
    let q = sqs
        .create_queue("jobs", QueueAttributes::default())
        .await
        .unwrap();
    q.send(SendMessage::new("0")).await.unwrap();
    let got = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    let receipt = got[0].receipt.clone();
    let receiving = {
        let q = q.clone();
        tokio::spawn(async move {
            q.receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(21)))
                .await
        })
    };
    wait_until("a receive in flight", || async {
        q.receives_in_flight() > 0
    })
    .await;
    sqs.sdk()
        .delete_queue()
        .queue_url(q.url())
        .send()
        .await
        .unwrap();
    let names_it = |e: &Error| matches!(e, Error::QueueNotFound { name } if name == "jobs");
    let cause = |e: &Error| match e {
        Error::SendBatchIncomplete { cause, .. } | Error::DeleteBatchIncomplete { cause, .. } => {
            names_it(cause)
        }
        other => names_it(other),
    };
    let calls: Vec<(&str, pgonce::Result<()>)> = vec![
        ("send", q.send(SendMessage::new("1")).await.map(drop)),
        (
            "send_batch",
            q.send_batch(vec![SendMessage::new("2"), SendMessage::new("3")])
                .await
                .map(drop),
        ),
        (
            "receive",
            q.receive(ReceiveRequest::up_to(1)).await.map(drop),
        ),
        ("delete", q.delete(&receipt).await),
        (
            "delete_batch",
            q.delete_batch(std::slice::from_ref(&receipt))
                .await
                .map(drop),
        ),
        (
            "change_visibility",
            q.change_visibility(&receipt, Duration::ZERO).await,
        ),
        ("stats", q.stats().await.map(drop)),
        ("purge", q.purge().await.map(drop)),
        ("receive under way", receiving.await.unwrap().map(drop)),
    ];
    for (what, got) in calls {
        assert!(got.as_ref().is_err_and(cause), "{what}: {got:?}");
    }
}
