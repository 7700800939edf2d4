//! A deduplicated batch (one statement, `send_batch_dedup.sql`) against
//! `send` one message at a time as the reference, and the locks sends take
//! through `pgonce.queue_lock_keys`, driven step by step across sessions.

mod support;

use support::database_with_queue;

use std::collections::HashMap;
use std::time::Duration;

use pgonce::{IsolationLevel, PgQueue, PgQueueOptions, Queue, QueueAttributes, SendMessage, Sent};
use pgonce_testkit::{Interleaving, fresh_database};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;

fn options() -> PgQueueOptions {
    PgQueueOptions {
        poll_interval: Duration::from_millis(100),
        ..PgQueueOptions::default()
    }
}

/// One message of a queue as the comparison sees it, in id order.
#[derive(sqlx::FromRow, Debug, PartialEq)]
struct Stored {
    id: i64,
    body: String,
    group_id: Option<String>,
    dedup_id: Option<String>,
    delay_s: i64,
}

async fn stored(pool: &PgPool, queue: &str) -> Vec<Stored> {
    sqlx::query_as(
        "SELECT id, body, group_id, dedup_id,
                round(extract(epoch FROM visible_at - sent_at))::bigint AS delay_s
         FROM pgonce.queue_message WHERE queue = $1 ORDER BY id",
    )
    .bind(queue)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Each send's answer with its id replaced by the position of that
/// message among the queue's (by id), so that two queues compare.
fn canonical(sent: &[Sent], messages: &[Stored]) -> Vec<(Option<usize>, bool)> {
    let position: HashMap<String, usize> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| (m.id.to_string(), i))
        .collect();
    sent.iter()
        .map(|s| (position.get(&s.id).copied(), s.duplicate))
        .collect()
}

fn random_batch(rng: &mut StdRng, fifo: bool, serial: &mut usize) -> Vec<SendMessage> {
    let n = rng.random_range(1..=10);
    (0..n)
        .map(|_| {
            *serial += 1;
            // Bodies repeat, so content-based ids repeat too.
            let body = match rng.random_range(0..4) {
                0 => format!("unique-{serial}"),
                k => format!("body-{k}"),
            };
            let mut m = SendMessage::new(body);
            if fifo {
                m = m.group(format!("g{}", rng.random_range(0..3)));
            }
            if rng.random_bool(0.7) {
                m = m.dedup(format!("d{}", rng.random_range(0..3)));
            }
            match rng.random_range(0..3) {
                0 => m = m.delay(Duration::from_secs(5)),
                1 => m = m.delay(Duration::ZERO),
                _ => {}
            }
            m
        })
        .collect()
}

/// Random batches, claims expired by hand between them: the batch queue
/// answers what `send` one message at a time answers on the reference
/// queue (ids, duplicates), and holds the same messages in the same
/// order.
#[tokio::test]
async fn a_deduplicated_batch_agrees_with_sends_one_at_a_time() {
    let db = fresh_database().await;
    let pool = db.pool(4).await.unwrap();
    pgonce::migrate(&pool).await.unwrap();
    let mut case = 0;
    for seed in 0..24u64 {
        for (fifo, by_content) in [(false, false), (false, true), (true, false), (true, true)] {
            case += 1;
            let mut rng = StdRng::seed_from_u64(seed);
            let suffix = if fifo { ".fifo" } else { "" };
            let (rname, bname) = (format!("r{case}{suffix}"), format!("b{case}{suffix}"));
            let mut attributes = if fifo {
                QueueAttributes::fifo()
            } else {
                QueueAttributes::default()
            };
            attributes.content_based_dedup = by_content;
            let reference = PgQueue::create(&pool, &rname, attributes.clone(), options())
                .await
                .unwrap();
            let batched = PgQueue::create(&pool, &bname, attributes, options())
                .await
                .unwrap();
            let (mut by_ref, mut by_batch) = (Vec::new(), Vec::new());
            let mut serial = 0;
            for _ in 0..8 {
                if rng.random_bool(0.3) {
                    // Expire some claims, the same ones in both queues.
                    let ids: Vec<String> = sqlx::query_scalar(
                        "SELECT dedup_id FROM pgonce.queue_dedup WHERE queue = $1
                         ORDER BY dedup_id",
                    )
                    .bind(&rname)
                    .fetch_all(&pool)
                    .await
                    .unwrap();
                    let expire: Vec<String> =
                        ids.into_iter().filter(|_| rng.random_bool(0.5)).collect();
                    sqlx::query(
                        "UPDATE pgonce.queue_dedup SET expires_at = now() - interval '1 second'
                         WHERE queue IN ($1, $2) AND dedup_id = ANY($3)",
                    )
                    .bind(&rname)
                    .bind(&bname)
                    .bind(&expire)
                    .execute(&pool)
                    .await
                    .unwrap();
                    continue;
                }
                let batch = random_batch(&mut rng, fifo, &mut serial);
                for m in batch.clone() {
                    by_ref.push(reference.send(m).await.unwrap());
                }
                by_batch.extend(batched.send_batch(batch).await.unwrap());
            }
            let (r, b) = (stored(&pool, &rname).await, stored(&pool, &bname).await);
            let strip = |v: &[Stored]| -> Vec<(String, Option<String>, Option<String>, i64)> {
                v.iter()
                    .map(|m| {
                        (
                            m.body.clone(),
                            m.group_id.clone(),
                            m.dedup_id.clone(),
                            m.delay_s,
                        )
                    })
                    .collect()
            };
            assert_eq!(
                strip(&b),
                strip(&r),
                "seed {seed} fifo {fifo} by_content {by_content}: messages"
            );
            assert_eq!(
                canonical(&by_batch, &b),
                canonical(&by_ref, &r),
                "seed {seed} fifo {fifo} by_content {by_content}: answers"
            );
            assert!(
                canonical(&by_batch, &b).iter().all(|(p, _)| p.is_some()),
                "every answer names a stored message: {by_batch:?}"
            );
        }
    }
}

fn fifo_batch(messages: &[(&str, &str, Option<&str>)]) -> Vec<SendMessage> {
    messages
        .iter()
        .map(|(body, group, id)| {
            let m = SendMessage::new(*body).group(*group);
            match id {
                Some(id) => m.dedup(*id),
                None => m,
            }
        })
        .collect()
}

/// A holds a batch in its open transaction; B's batch, sharing groups and
/// ids with it, is seen waiting for A; A commits (or rolls back). B's
/// answers and the groups' order are those of B sent after A's outcome.
async fn batch_behind_a_batch(commit: bool) {
    let (db, setup) = database_with_queue("f.fifo", QueueAttributes::fifo()).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let qa = PgQueue::open(a.pool(), "f.fifo", options()).await.unwrap();
    let qb = PgQueue::open(b.pool(), "f.fifo", options()).await.unwrap();
    let mut tx = a.pool().begin().await.unwrap();
    let by_a = race
        .try_step(
            &a,
            "send a batch, open",
            qa.send_batch_in(
                &mut tx,
                fifo_batch(&[("a1", "g1", Some("x")), ("a2", "g2", Some("y"))]),
            ),
        )
        .await
        .unwrap();
    let sending = race
        .step_blocks(&b, "send a batch sharing x, y, g1, g2", async move {
            qb.send_batch(fifo_batch(&[
                ("b1", "g2", Some("y")),
                ("b2", "g1", Some("z")),
                ("b3", "g1", Some("x")),
                ("b4", "g1", None),
            ]))
            .await
        })
        .await
        .unwrap();
    assert_eq!(sending.blocked_by(), ["A"]);
    if commit {
        race.try_step(&a, "commit", tx.commit()).await.unwrap();
    } else {
        race.try_step(&a, "roll back", tx.rollback()).await.unwrap();
    }
    let by_b = sending.resume().await.unwrap().unwrap();
    let duplicates: Vec<bool> = by_b.iter().map(|s| s.duplicate).collect();
    let bodies: Vec<(String, Option<String>)> = stored(&setup, "f.fifo")
        .await
        .into_iter()
        .map(|m| (m.body, m.group_id))
        .collect();
    let expect = |v: &[(&str, &str)]| -> Vec<(String, Option<String>)> {
        v.iter()
            .map(|(b, g)| (b.to_string(), Some(g.to_string())))
            .collect()
    };
    if commit {
        assert_eq!(duplicates, [true, false, true, false], "{by_b:?}");
        assert_eq!(by_b[0].id, by_a[1].id);
        assert_eq!(by_b[2].id, by_a[0].id);
        assert_eq!(
            bodies,
            expect(&[("a1", "g1"), ("a2", "g2"), ("b2", "g1"), ("b4", "g1")])
        );
    } else {
        assert_eq!(duplicates, [false; 4], "{by_b:?}");
        assert_eq!(
            bodies,
            expect(&[("b1", "g2"), ("b2", "g1"), ("b3", "g1"), ("b4", "g1")])
        );
    }
}

#[tokio::test]
async fn a_batch_behind_a_committed_batch_sharing_ids_and_groups() {
    batch_behind_a_batch(true).await;
}

#[tokio::test]
async fn a_batch_behind_a_rolled_back_batch_sharing_ids_and_groups() {
    batch_behind_a_batch(false).await;
}

/// The sends that have keys still lock them through
/// `pgonce.queue_lock_keys` (the CASE skips only an empty key set): with A
/// holding a send in its open transaction, B's send of `then` waits for A.
async fn waits_behind(
    attributes: QueueAttributes,
    name: &str,
    held: SendMessage,
    then: Vec<SendMessage>,
) {
    let (db, _setup) = database_with_queue(name, attributes).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let qa = PgQueue::open(a.pool(), name, options()).await.unwrap();
    let qb = PgQueue::open(b.pool(), name, options()).await.unwrap();
    let mut tx = a.pool().begin().await.unwrap();
    race.try_step(&a, "send, open", qa.send_in(&mut tx, held))
        .await
        .unwrap();
    let one = then.len() == 1;
    let sending = race
        .step_blocks(&b, "send", async move {
            if one {
                qb.send(then.into_iter().next().unwrap())
                    .await
                    .map(|s| vec![s])
            } else {
                qb.send_batch(then).await
            }
        })
        .await
        .unwrap();
    assert_eq!(sending.blocked_by(), ["A"]);
    race.try_step(&a, "commit", tx.commit()).await.unwrap();
    sending.resume().await.unwrap().unwrap();
}

#[tokio::test]
async fn a_fifo_send_waits_for_its_groups_sender() {
    waits_behind(
        QueueAttributes::fifo(),
        "f.fifo",
        SendMessage::new("a").group("g"),
        vec![SendMessage::new("b").group("g")],
    )
    .await;
}

#[tokio::test]
async fn a_fifo_batch_without_ids_waits_for_its_groups_sender() {
    waits_behind(
        QueueAttributes::fifo(),
        "f.fifo",
        SendMessage::new("a").group("g"),
        vec![
            SendMessage::new("b").group("h"),
            SendMessage::new("c").group("g"),
        ],
    )
    .await;
}

/// (The claim's row would make B wait as well: this one holds whichever
/// of the two B meets first.)
#[tokio::test]
async fn a_standard_send_with_an_id_waits_for_its_ids_sender() {
    waits_behind(
        QueueAttributes::default(),
        "q",
        SendMessage::new("a").dedup("d"),
        vec![SendMessage::new("b").dedup("d")],
    )
    .await;
}

/// A duplicate batch send of a long-claimed id leaves the claim as it
/// was: a REPEATABLE READ transaction whose snapshot predates it then
/// sends that id as a duplicate, as it does after a duplicate `send`.
#[tokio::test]
async fn a_duplicate_batch_does_not_rewrite_a_live_claim() {
    let (_db, pool) = database_with_queue("q", QueueAttributes::default()).await;
    let q = PgQueue::open(&pool, "q", options()).await.unwrap();
    let first = q.send(SendMessage::new("first").dedup("d")).await.unwrap();
    let mut early = pgonce::begin(&pool, IsolationLevel::RepeatableRead)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM pgonce.queue_dedup")
        .execute(&mut *early)
        .await
        .unwrap();
    let again = q
        .send_batch(vec![SendMessage::new("again").dedup("d")])
        .await
        .unwrap();
    assert!(again[0].duplicate && again[0].id == first.id, "{again:?}");
    let late = q
        .send_in(&mut early, SendMessage::new("late").dedup("d"))
        .await;
    early.rollback().await.unwrap();
    let late = late.expect("a duplicate in a REPEATABLE READ transaction");
    assert!(late.duplicate && late.id == first.id, "{late:?}");
}

/// A REPEATABLE READ sender of an id that another sender claims while it
/// waits for the id's lock: A sends `d` in its open transaction; B, whose
/// snapshot was taken before, sends `d` and is seen waiting for A; A
/// commits. B's snapshot cannot see A's message, so B can neither send `d`
/// again nor answer with A's message: it gets a serialization failure,
/// retryable (a retried transaction sees A's claim and answers
/// duplicate), whether it sent one message or a batch, and B's transaction
/// wrote nothing.
async fn a_repeatable_read_send_behind_a_claim_of_its_id(batch: bool) {
    let (db, setup) = database_with_queue("q", QueueAttributes::default()).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let qa = PgQueue::open(a.pool(), "q", options()).await.unwrap();
    let qb = PgQueue::open(b.pool(), "q", options()).await.unwrap();
    let mut by_a = a.pool().begin().await.unwrap();
    let sent_by_a = race
        .try_step(
            &a,
            "send d, open",
            qa.send_in(&mut by_a, SendMessage::new("a").dedup("d")),
        )
        .await
        .unwrap();
    let mut by_b = pgonce::begin(b.pool(), IsolationLevel::RepeatableRead)
        .await
        .unwrap();
    race.try_step(
        &b,
        "take a snapshot",
        sqlx::query("SELECT count(*) FROM pgonce.queue_dedup").execute(&mut *by_b),
    )
    .await
    .unwrap();
    let sending = race
        .step_blocks(&b, "send d", async move {
            let message = SendMessage::new("b").dedup("d");
            let sent = if batch {
                qb.send_batch_in(&mut by_b, vec![message, SendMessage::new("c")])
                    .await
                    .map(|_| ())
            } else {
                qb.send_in(&mut by_b, message).await.map(|_| ())
            };
            by_b.rollback().await.unwrap();
            sent
        })
        .await
        .unwrap();
    assert_eq!(sending.blocked_by(), ["A"]);
    race.try_step(&a, "commit", by_a.commit()).await.unwrap();
    let outcome = sending.resume().await.unwrap();
    assert!(
        matches!(&outcome, Err(e @ pgonce::Error::SerializationFailure { .. }) if e.is_retryable()),
        "batch {batch}: {outcome:?}"
    );
    let kept: Vec<String> = stored(&setup, "q")
        .await
        .into_iter()
        .map(|m| m.body)
        .collect();
    assert_eq!(kept, ["a"]);
    let again = PgQueue::open(&setup, "q", options())
        .await
        .unwrap()
        .send(SendMessage::new("b").dedup("d"))
        .await
        .unwrap();
    assert_eq!((again.id, again.duplicate), (sent_by_a.id, true));
}

#[tokio::test]
async fn a_repeatable_read_send_behind_a_claim_of_its_id_fails_to_serialize() {
    a_repeatable_read_send_behind_a_claim_of_its_id(false).await;
}

#[tokio::test]
async fn a_repeatable_read_batch_behind_a_claim_of_its_id_fails_to_serialize() {
    a_repeatable_read_send_behind_a_claim_of_its_id(true).await;
}

/// A session holding `pgonce.queue` whole (ACCESS EXCLUSIVE) in its open
/// transaction, with queue `q`'s content-based deduplication turned over
/// in it: every statement that reads the queue waits for it, and sees the
/// setting turned over once it commits.
async fn turned_over(
    pool: sqlx::PgPool,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("LOCK TABLE pgonce.queue IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE pgonce.queue SET content_based_dedup = NOT content_based_dedup WHERE name = 'q'",
    )
    .execute(&mut *tx)
    .await?;
    Ok(tx)
}

/// The most statements [`a_send_outrun_by_its_queues_setting`] lets a send
/// run: three attempts and three reads of the setting take six.
const OUTRUN_ROUNDS: usize = 12;

/// A send whose queue's content-based deduplication turns over before
/// each of its statements: every attempt goes under the setting the
/// handle read last, and finds it changed. Step by step: a holder session
/// (A and C in turn) has the queue table locked with the setting turned
/// over; B's send is seen waiting for it; the next holder is seen waiting
/// behind B; the holder commits, so B runs one statement and waits for
/// the next holder. A single send and a batch give up alike after three
/// attempts with [`pgonce::Error::QueueChangedDuringSend`], having sent
/// nothing. A batch used to try again without end (each refusal read the
/// setting and sent again).
async fn a_send_outrun_by_its_queues_setting(batch: bool) {
    let (db, setup) = database_with_queue("q", QueueAttributes::default()).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let holders = [
        race.session("A").await.unwrap(),
        race.session("C").await.unwrap(),
    ];
    let b = race.session("B").await.unwrap();
    // B's statements prepared beforehand, on a queue of their own: a
    // statement's first preparation reads the queue table in a
    // transaction of its own, which would take a round of its own.
    PgQueue::create(&setup, "warm", QueueAttributes::default(), options())
        .await
        .unwrap();
    // No notifications: B's one connection runs the sends' statements only.
    let quiet = PgQueueOptions {
        notify: false,
        ..options()
    };
    let warm = PgQueue::open(b.pool(), "warm", quiet.clone())
        .await
        .unwrap();
    warm.send(SendMessage::new("w")).await.unwrap();
    warm.send_batch(vec![SendMessage::new("w")]).await.unwrap();
    warm.send_batch(vec![SendMessage::new("w").dedup("w")])
        .await
        .unwrap();
    let qb = PgQueue::open(b.pool(), "q", quiet).await.unwrap();
    let mut held = race
        .try_step(
            &holders[0],
            "lock, turn over",
            turned_over(holders[0].pool().clone()),
        )
        .await
        .unwrap();
    let sending = tokio::spawn(async move {
        let messages = vec![SendMessage::new("m"), SendMessage::new("n")];
        if batch {
            qb.send_batch(messages).await.map(|_| ())
        } else {
            qb.send(messages.into_iter().next().unwrap())
                .await
                .map(|_| ())
        }
    });
    assert_eq!(race.wait_until_blocked(&b, "send").await.unwrap(), ["A"]);
    let mut rounds = 0;
    while !sending.is_finished() {
        rounds += 1;
        assert!(
            rounds <= OUTRUN_ROUNDS,
            "batch {batch}: still sending after {OUTRUN_ROUNDS} statements"
        );
        let next = &holders[rounds % 2];
        let waiting = race
            .step_blocks(next, "lock, turn over", turned_over(next.pool().clone()))
            .await
            .unwrap();
        race.try_step(&holders[(rounds + 1) % 2], "commit", held.commit())
            .await
            .unwrap();
        held = waiting.try_resume().await.unwrap();
        // B is waiting for the new holder, or done.
        while !sending.is_finished() && race.blockers_of(&b).await.unwrap().is_none() {
            tokio::task::yield_now().await;
        }
    }
    held.rollback().await.unwrap();
    let outcome = sending.await.unwrap();
    assert!(
        matches!(
            &outcome,
            Err(e @ pgonce::Error::QueueChangedDuringSend { queue, attempts: 3 })
                if queue == "q" && e.is_retryable()
        ),
        "batch {batch}: {outcome:?}"
    );
    assert_eq!(rounds, 6, "batch {batch}: three attempts, three reads");
    assert!(stored(&setup, "q").await.is_empty());
}

#[tokio::test]
async fn a_send_outrun_by_its_queues_setting_gives_up_after_three_attempts() {
    a_send_outrun_by_its_queues_setting(false).await;
}

#[tokio::test]
async fn a_batch_outrun_by_its_queues_setting_gives_up_after_three_attempts() {
    a_send_outrun_by_its_queues_setting(true).await;
}
