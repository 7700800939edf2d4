//! Calls that take something only their caller can let go of (a queue
//! receive's deliveries, a job claim's leases, an idempotency key's hold),
//! each dropped at a random point of its run, checked against what it may
//! leave: what the caller got is taken, everything else is as if the call
//! never ran. Beside the step-by-step drop tests of each module, which stop
//! a call at one chosen statement, these drop it wherever a random timeout
//! falls: while it acquires a connection, while a statement is in flight,
//! between statements, after its answer. The verdict of a round never
//! depends on where the drop fell, only on what the caller got.
//!
//! A round waits for the pool to go idle before it judges: a call dropped
//! mid-statement is finished, and what it took given back, by a task of
//! its own that holds the connection until then.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use pgonce::dedupe::{self, Acquired};
use pgonce::job::{self, JobStatus, NewJob};
use pgonce::queue::{PgQueue, PgQueueOptions, Queue, QueueAttributes, ReceiveRequest, SendMessage};
use pgonce_testkit::fresh_migrated_database;
use pgonce_testkit::logs::LogLines;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use sqlx::PgPool;

/// Rounds per call; `DROPPED_CALL_ROUNDS` sets another number.
fn rounds() -> usize {
    std::env::var("DROPPED_CALL_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(150)
}

/// A generator seeded from `DROPPED_CALL_SEED`, or at random; the seed is
/// printed, for a failing run's replay (of its schedule: where the drops
/// fall also depends on the machine).
fn seeded(call: &str) -> StdRng {
    let seed = std::env::var("DROPPED_CALL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("{call}: DROPPED_CALL_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// Waits until every connection of `pool` is back and idle: a dropped
/// call's task has then finished its work and given back what it took.
async fn idle(pool: &PgPool) {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while pool.num_idle() < pool.size() as usize {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "the pool never went idle: a dropped call's task still holds a connection"
    );
}

/// How the rounds of one call ended.
#[derive(Default)]
struct Tally {
    /// How long each call that answered within its time took.
    answered: Vec<Duration>,
    /// Calls dropped first.
    dropped: usize,
}

impl Tally {
    /// Runs `call` for as long as [`Self::drop_after`] draws, then drops
    /// it: its answer, or `None` when it was dropped.
    async fn answer_or_drop<T>(
        &mut self,
        rng: &mut StdRng,
        call: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        let started = Instant::now();
        let answer = tokio::time::timeout(self.drop_after(rng), call).await.ok();
        match answer {
            Some(_) => self.answered.push(started.elapsed()),
            None => self.dropped += 1,
        }
        answer
    }

    /// How long a round lets its call run before dropping it: not at all
    /// (one poll), or up to twice the median call that answered so far (a
    /// millisecond at first), so that on a machine fast or slow some calls
    /// answer, some are dropped before they send anything, and some with a
    /// statement in flight.
    fn drop_after(&self, rng: &mut StdRng) -> Duration {
        if rng.random_ratio(1, 10) {
            return Duration::ZERO;
        }
        let mut answered = self.answered.clone();
        answered.sort_unstable();
        let median = answered
            .get(answered.len() / 2)
            .copied()
            .unwrap_or(Duration::from_millis(1));
        median.mul_f64(2.0 * rng.random::<f64>())
    }

    /// Checks that some rounds gave back what a dropped call took, logged
    /// at debug as `given_back`: else no drop fell mid-statement, and the
    /// rounds tested nothing.
    fn assert_some_given_back(&self, logged: &LogLines, call: &str, given_back: &str) {
        let given = logged.starting(tracing::Level::DEBUG, given_back).len();
        let answered = self.answered.len();
        let dropped = self.dropped;
        eprintln!("{call}: {answered} answered, {dropped} dropped, {given} given back");
        assert!(
            given > 0,
            "no {call} dropped mid-statement ({answered} answered, {dropped} dropped): \
             nothing was tested"
        );
    }
}

/// A message of the queue as a round judges it.
#[derive(sqlx::FromRow)]
struct StoredMessage {
    body: String,
    receive_count: i32,
    /// Receivable now.
    visible: bool,
}

/// A receive dropped at random: each message sent is either delivered to
/// the caller (counted once, invisible) or receivable now, its receive
/// uncounted; none is lost. On a FIFO queue, the messages are sent in two
/// groups, and a give-back must hand back the heads it took.
async fn a_receive_dropped_anywhere_leaves_each_message_delivered_or_receivable(fifo: bool) {
    let (_db, pool) = fresh_migrated_database(4, pgonce::migrate).await;
    let (name, attributes, call) = if fifo {
        ("q.fifo", QueueAttributes::fifo(), "FIFO receive")
    } else {
        ("q", QueueAttributes::default(), "receive")
    };
    let q = PgQueue::create(&pool, name, attributes, PgQueueOptions::default())
        .await
        .unwrap();
    let logged = LogLines::default();
    let _logging = logged.capture();
    let mut rng = seeded(call);
    let mut tally = Tally::default();
    for round in 0..rounds() {
        let n = rng.random_range(1..=4);
        let sent: BTreeSet<String> = (0..n).map(|i| format!("r{round}-m{i}")).collect();
        for (i, body) in sent.iter().enumerate() {
            let message = SendMessage::new(body.clone());
            let message = if fifo {
                message.group(format!("g{}", i % 2))
            } else {
                message
            };
            q.send(message).await.unwrap();
        }
        let request = ReceiveRequest::up_to(rng.random_range(1..=n));
        let delivered: BTreeSet<String> =
            match tally.answer_or_drop(&mut rng, q.receive(request)).await {
                Some(received) => received.unwrap().into_iter().map(|m| m.body).collect(),
                None => BTreeSet::new(),
            };
        idle(&pool).await;
        let rows: Vec<StoredMessage> = sqlx::query_as(
            "SELECT body, receive_count, visible_at <= now() AS visible \
             FROM pgonce.queue_message WHERE queue = $1 ORDER BY id",
        )
        .bind(name)
        .fetch_all(&pool)
        .await
        .unwrap();
        let stored: BTreeSet<String> = rows.iter().map(|m| m.body.clone()).collect();
        assert_eq!(stored, sent, "round {round}: every message is still there");
        for m in &rows {
            let expected = if delivered.contains(&m.body) {
                (1, false)
            } else {
                (0, true)
            };
            assert_eq!(
                (m.receive_count, m.visible),
                expected,
                "round {round}: {} (receive count, visible), delivered to the caller: {}",
                m.body,
                delivered.contains(&m.body)
            );
        }
        if fifo {
            // Each group the caller got none of goes on from its first
            // message, its head: a give-back hands the heads it took back.
            let group_of = |body: &String| sent.iter().position(|b| b == body).unwrap() % 2;
            let busy: BTreeSet<usize> = delivered.iter().map(group_of).collect();
            let heads: BTreeSet<&String> = (0..2)
                .filter(|g| !busy.contains(g))
                .filter_map(|g| sent.iter().find(|b| group_of(b) == g))
                .collect();
            let next = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
            let next: BTreeSet<&String> = next.iter().map(|m| &m.body).collect();
            assert_eq!(
                next, heads,
                "round {round}: the groups the caller left go on"
            );
        }
        sqlx::query("DELETE FROM pgonce.queue_message WHERE queue = $1")
            .bind(name)
            .execute(&pool)
            .await
            .unwrap();
    }
    tally.assert_some_given_back(&logged, call, "deliveries given back");
}

#[tokio::test]
async fn a_standard_receive_dropped_anywhere_leaves_each_message_delivered_or_receivable() {
    a_receive_dropped_anywhere_leaves_each_message_delivered_or_receivable(false).await;
}

#[tokio::test]
async fn a_fifo_receive_dropped_anywhere_leaves_each_message_delivered_or_receivable() {
    a_receive_dropped_anywhere_leaves_each_message_delivered_or_receivable(true).await;
}

/// A job claim batch dropped at random: each job is either claimed for
/// the caller (processing) or pending, runnable at once, no attempt
/// counted.
#[tokio::test]
async fn a_claim_batch_dropped_anywhere_leaves_each_job_claimed_or_pending() {
    let (_db, pool) = fresh_migrated_database(4, pgonce::migrate).await;
    let logged = LogLines::default();
    let _logging = logged.capture();
    let mut rng = seeded("claim_batch");
    let mut tally = Tally::default();
    for round in 0..rounds() {
        let n = rng.random_range(1..=4);
        let mut jobs = Vec::new();
        for _ in 0..n {
            let id = job::enqueue(&pool, &NewJob::new("send", json!({"round": round})))
                .await
                .unwrap();
            jobs.push(id);
        }
        let limit = rng.random_range(1..=n) as i64;
        let call = job::claim_batch(&pool, "send", limit, Duration::from_secs(60));
        let claimed: BTreeSet<i64> = match tally.answer_or_drop(&mut rng, call).await {
            Some(claimed) => claimed.unwrap().iter().map(|j| j.lease.job_id).collect(),
            None => BTreeSet::new(),
        };
        idle(&pool).await;
        for id in jobs {
            let stored = job::get(&pool, id).await.unwrap().unwrap();
            let expected = if claimed.contains(&id) {
                JobStatus::Processing
            } else {
                JobStatus::Pending
            };
            assert_eq!(
                (stored.status().unwrap(), stored.attempts),
                (expected, 0),
                "round {round}: job {id} (status, attempts), claimed by the caller: {}",
                claimed.contains(&id)
            );
        }
        sqlx::query("DELETE FROM pgonce.jobs")
            .execute(&pool)
            .await
            .unwrap();
    }
    tally.assert_some_given_back(&logged, "claim_batch", "job lease given back");
}

/// An idempotency key's acquire dropped at random: the key is either held
/// by the caller or free, a new request for it processed at once; never
/// held by nobody, turning its retries away as in progress.
#[tokio::test]
async fn an_acquire_dropped_anywhere_leaves_the_key_held_by_the_caller_or_free() {
    let (_db, pool) = fresh_migrated_database(4, pgonce::migrate).await;
    let logged = LogLines::default();
    let _logging = logged.capture();
    let mut rng = seeded("acquire");
    let mut tally = Tally::default();
    let hold_for = Duration::from_secs(60);
    for round in 0..rounds() {
        let key = format!("k{round}");
        let call = dedupe::acquire(&pool, "s", &key, b"request", hold_for);
        let held = match tally.answer_or_drop(&mut rng, call).await {
            Some(acquired) => match acquired.unwrap() {
                Acquired::Process(hold) => Some(hold),
                Acquired::Replay(response) => {
                    panic!("round {round}: a new key replayed {response}")
                }
            },
            None => None,
        };
        idle(&pool).await;
        let again = dedupe::acquire(&pool, "s", &key, b"request", hold_for).await;
        match held {
            Some(hold) => {
                assert!(
                    again.is_err(),
                    "round {round}: held by the caller, the key turns another request away: \
                     {again:?}"
                );
                dedupe::release(&pool, &hold).await.unwrap();
            }
            None => match again {
                Ok(Acquired::Process(hold)) => dedupe::release(&pool, &hold).await.unwrap(),
                other => {
                    panic!("round {round}: the caller got nothing, so the key is free: {other:?}")
                }
            },
        }
    }
    tally.assert_some_given_back(&logged, "acquire", "idempotency key hold given back");
}
