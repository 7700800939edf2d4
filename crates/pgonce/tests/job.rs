//! Jobs against a real PostgreSQL: two-phase claims fenced by leases,
//! heartbeat, the reaper, DB-driven retry, 40001 under REPEATABLE READ, a
//! connection killed mid-claim, and a property test of the state machine.
//! One job delivered twice under each guard (the conditional transition's
//! `AlreadyHandled`, the claim loser's `JobBusy`) is replayed step by step
//! by `pgonce race jobs` and asserted on in `crates/pgonce-lab/tests/races.rs`.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pgonce::Error;
use pgonce::IsolationLevel;
use pgonce::job::{
    self, DeadJobFilter, FailOutcome, JobStatus, NewJob, ReapCounts, Reaper, ReaperConfig,
    Redriver, RedriverConfig, RetryPolicy,
};
use pgonce_testkit::{Interleaving, fresh_migrated_database};
use serde_json::json;
use sqlx::PgPool;
use support::expire_lease;

const LEASE: Duration = Duration::from_secs(60);

async fn setup() -> (pgonce_testkit::ScratchDatabase, PgPool) {
    let (db, pool) = fresh_migrated_database(16, pgonce::migrate).await;
    (db, pool)
}

async fn new_job(pool: &PgPool, max_attempts: i32) -> i64 {
    job::enqueue(
        pool,
        &NewJob::new("send", json!({"to": "x"})).max_attempts(max_attempts),
    )
    .await
    .unwrap()
}

async fn status(pool: &PgPool, id: i64) -> JobStatus {
    job::get(pool, id).await.unwrap().unwrap().status().unwrap()
}

/// Terminates the backend of `session`'s connection, as a crash would.
async fn kill_session(pool: &PgPool, session: &pgonce_testkit::Session) {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(session.pool())
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(pool)
        .await
        .unwrap();
}

/// B's step waits for a row A's transaction holds: checks that A is the
/// blocker, commits A, and returns B's outcome.
async fn commit_a_then_resume<T: Send + 'static>(
    race: &Interleaving,
    a: &pgonce_testkit::Session,
    tx_a: sqlx::Transaction<'static, sqlx::Postgres>,
    waiting: pgonce_testkit::Blocked<T>,
) -> T {
    assert_eq!(waiting.blocked_by(), ["A"]);
    race.step(a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    waiting.resume().await.unwrap()
}

fn reaper(pool: &PgPool) -> Reaper {
    Reaper::new(pool.clone(), ReaperConfig::default()).unwrap()
}

/// A claim on B's pool seen waiting for A's, made in a transaction A
/// keeps open.
struct ClaimBehindA {
    a: pgonce_testkit::Session,
    b: pgonce_testkit::Session,
    tx_a: sqlx::Transaction<'static, sqlx::Postgres>,
    lease_a: job::Lease,
    waiting: pgonce_testkit::Blocked<pgonce::Result<job::Lease>>,
}

/// Two deliveries claim job `id`: A claims in a transaction, B's claim is
/// seen waiting for A's row lock.
async fn claim_behind_a(race: &Interleaving, id: i64) -> ClaimBehindA {
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let mut tx_a = a.pool().begin().await.unwrap();
    let lease_a = race
        .step(&a, "claim", job::claim(&mut *tx_a, id, LEASE))
        .await
        .unwrap()
        .unwrap();
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(
            &b,
            "claim",
            async move { job::claim(&pool_b, id, LEASE).await },
        )
        .await
        .unwrap();
    ClaimBehindA {
        a,
        b,
        tx_a,
        lease_a,
        waiting,
    }
}

/// Two deliveries claim job `id`: A claims in a transaction, B's claim is
/// seen waiting for A's row lock, A commits, B's claim returns. Gives A's
/// session and lease and B's outcome.
async fn claim_race(
    race: &Interleaving,
    id: i64,
) -> (
    pgonce_testkit::Session,
    job::Lease,
    pgonce::Result<job::Lease>,
) {
    let ClaimBehindA {
        a,
        tx_a,
        lease_a,
        waiting,
        ..
    } = claim_behind_a(race, id).await;
    let b_claim = commit_a_then_resume(race, &a, tx_a, waiting).await;
    (a, lease_a, b_claim)
}

/// A duplicate delivery that loses the claim to a delivery still at work
/// must keep its message: acknowledging it (as `AlreadyHandled` used to tell
/// it to) leaves nothing to drive the job once the claimer crashes and the
/// reaper returns the job to pending.
#[tokio::test]
async fn a_claim_loser_sees_busy_keeps_its_message_and_drives_the_reaped_job_once() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (a, a_lease, b_claim) = claim_race(&race, id).await;

    // B sees the job busy, not handled: under either policy it keeps the
    // message, and learns when the job can come back at the earliest.
    match &b_claim {
        Err(Error::JobBusy {
            job_id,
            status: JobStatus::Processing,
            not_before,
        }) => {
            assert_eq!(*job_id, id);
            assert_eq!(*not_before, a_lease.expires_at);
        }
        other => panic!("the loser must see the job busy, got {other:?}"),
    }
    assert!(!pgonce::AckPolicy::DeleteOnSuccess.delete_message(&b_claim));
    assert!(!pgonce::AckPolicy::AlwaysDelete.delete_message(&b_claim));

    // A dies before its side effect; its lease runs out; the reaper
    // returns the job.
    kill_session(&pool, &a).await;
    race.note(&a, "dies holding the claim");
    expire_lease(&pool, id).await;
    assert_eq!(reaper(&pool).run_once().await.unwrap().returned, 1);

    // B's kept message comes back and drives the job, once.
    let mut side_effects = 0;
    let lease = job::claim(&pool, id, LEASE)
        .await
        .expect("the redelivered message claims the reaped job");
    side_effects += 1;
    job::complete(&pool, &lease, &json!({"by": "B"}))
        .await
        .unwrap();
    // Any further copy of the message finds the job done and acknowledges.
    let again = job::claim(&pool, id, LEASE).await;
    assert!(
        matches!(again, Err(Error::AlreadyHandled { .. })),
        "{again:?}"
    );
    assert!(pgonce::AckPolicy::DeleteOnSuccess.delete_message(&again));
    assert_eq!(side_effects, 1);
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(row.status, "completed");
    assert_eq!(row.result, Some(Ok(json!({"by": "B"}))));
    assert_eq!(row.attempts, 1, "the dead claimer's lease counted");
}

/// A claimer that died leaves its job processing until its lease runs
/// out and the reaper's next pass. A delivery of the job's kept message in
/// between, after the lease ran out, was told `JobBusy` with a
/// `not_before` already past: the worker hid the message a second, and
/// each return counted as a receive, towards the dead-letter queue, for as
/// long as the reaper's interval. That delivery takes the job over now, as
/// the reaper would have returned it: the dead claimer's attempt counted,
/// a fresh lease, the old one lost. On the last attempt the claim makes
/// the job dead, as the reaper would, and answers `AlreadyHandled`: a
/// final status the worker acknowledges, not a `JobBusy` with a
/// `not_before` already past until the reaper's next pass.
#[tokio::test]
async fn a_claim_takes_over_a_lease_that_ran_out_without_waiting_for_the_reaper() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 2).await;
    let dead_claimer = job::claim(&pool, id, LEASE).await.unwrap();
    let busy = async || {
        let out = job::claim(&pool, id, LEASE).await;
        matches!(
            out,
            Err(Error::JobBusy {
                status: JobStatus::Processing,
                ..
            })
        )
    };
    assert!(busy().await, "a live lease is busy");
    expire_lease(&pool, id).await;
    let lease = job::claim(&pool, id, LEASE)
        .await
        .expect("the lease ran out: the claim takes the job over");
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(
        (row.status().unwrap(), row.attempts, row.lease_token),
        (JobStatus::Processing, 1, Some(lease.token))
    );
    assert!(row.last_error.unwrap().contains("lease expired"));
    let out = job::complete(&pool, &dead_claimer, &json!("late")).await;
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
    assert_eq!(
        reaper(&pool).run_once().await.unwrap(),
        ReapCounts::default()
    );

    // The last attempt's lease runs out: the claim makes the job dead.
    expire_lease(&pool, id).await;
    let out = job::claim(&pool, id, LEASE).await;
    assert!(
        matches!(out, Err(Error::AlreadyHandled { job_id, .. }) if job_id == id),
        "a final status, not JobBusy until the reaper passes: {out:?}"
    );
    assert_eq!(
        reaper(&pool).run_once().await.unwrap(),
        ReapCounts::default()
    );
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!((row.status().unwrap(), row.attempts), (JobStatus::Dead, 2));
    assert!(
        row.last_error
            .unwrap()
            .contains("lease expired on the last")
    );
}

/// Claims the job named by the message, runs the side effect (a counter),
/// completes it. `AlreadyHandled` is success; anything else (`JobBusy`
/// included) is returned to the worker.
struct ClaimingHandler {
    pool: PgPool,
    side_effects: std::sync::atomic::AtomicU32,
}

impl pgonce::Handler for ClaimingHandler {
    async fn handle(&self, m: &pgonce::Received) -> Result<(), pgonce::HandlerError> {
        let id: i64 = m.body.parse()?;
        let lease = match job::claim(&self.pool, id, LEASE).await {
            Ok(lease) => lease,
            Err(Error::AlreadyHandled { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        self.side_effects
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        job::complete(&self.pool, &lease, &json!("done")).await?;
        Ok(())
    }
}

/// The worker runtime keeps the message of a busy job even under
/// `AlwaysDelete`, and that message completes the job once its claimer
/// crashed and the reaper returned it.
#[tokio::test]
async fn the_worker_keeps_a_busy_jobs_message_which_completes_the_reaped_job() {
    use pgonce::{PgQueue, PgQueueOptions, Queue, QueueAttributes, SendMessage};
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let q = PgQueue::create(
        &pool,
        "jobs",
        QueueAttributes::default(),
        PgQueueOptions::default(),
    )
    .await
    .unwrap();
    q.send(SendMessage::new(id.to_string())).await.unwrap();
    // Another delivery claimed the job and then crashed (never completes).
    job::claim(&pool, id, LEASE).await.unwrap();

    let config = pgonce::WorkerConfig {
        ack: pgonce::AckPolicy::AlwaysDelete,
        heartbeat_interval: None,
        ..pgonce::WorkerConfig::default()
    };
    let handler = ClaimingHandler {
        pool: pool.clone(),
        side_effects: Default::default(),
    };
    let worker = pgonce::Worker::new(q.clone(), handler, config).unwrap();
    let first = worker.run_once().await.unwrap();
    assert_eq!((first.received, first.deleted), (1, 0), "{first:?}");
    #[derive(sqlx::FromRow)]
    struct Kept {
        kept: i64,
        visible_at: Option<time::OffsetDateTime>,
    }
    let Kept { kept, visible_at } = sqlx::query_as(
        "SELECT count(*) AS kept, max(visible_at) AS visible_at \
         FROM pgonce.queue_message WHERE queue = 'jobs'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(kept, 1, "the busy job's message is kept");
    let lease_end = job::get(&pool, id)
        .await
        .unwrap()
        .unwrap()
        .lease_expires_at
        .unwrap();
    assert!(
        visible_at.unwrap() >= lease_end - time::Duration::seconds(2),
        "hidden until the lease can have expired: {visible_at:?} vs {lease_end}"
    );

    expire_lease(&pool, id).await;
    assert_eq!(reaper(&pool).run_once().await.unwrap().returned, 1);
    // The message's hiding time passes.
    sqlx::query("UPDATE pgonce.queue_message SET visible_at = now() WHERE queue = 'jobs'")
        .execute(&pool)
        .await
        .unwrap();
    let second = worker.run_once().await.unwrap();
    assert_eq!((second.succeeded, second.deleted), (1, 1), "{second:?}");
    assert_eq!(
        worker
            .handler()
            .side_effects
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    assert_eq!(status(&pool, id).await, JobStatus::Completed);
}

#[tokio::test]
async fn a_worker_whose_lease_was_taken_over_cannot_overwrite_the_new_owners_result() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let old = job::claim(&pool, id, LEASE).await.unwrap();
    expire_lease(&pool, id).await;
    let reaped = reaper(&pool).run_once().await.unwrap();
    assert_eq!(reaped.returned, 1);
    let new = job::claim(&pool, id, LEASE).await.unwrap();
    assert_ne!(old.token, new.token);

    let late = job::complete(&pool, &old, &json!({"by": "old"})).await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    let late_fail = job::fail(&pool, &old, "late", &RetryPolicy::default()).await;
    assert!(matches!(late_fail, Err(Error::LeaseLost { .. })));
    let late_beat = job::heartbeat(&pool, &old, LEASE).await;
    assert!(matches!(late_beat, Err(Error::LeaseLost { .. })));

    job::complete(&pool, &new, &json!({"by": "new"}))
        .await
        .unwrap();
    let late = job::complete(&pool, &old, &json!({"by": "old"})).await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })));
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(row.status, "completed");
    assert_eq!(row.result, Some(Ok(json!({"by": "new"}))));
    assert_eq!(row.attempts, 1, "the expired lease counted as an attempt");
}

#[tokio::test]
async fn a_heartbeat_keeps_a_slow_workers_lease_from_being_reaped() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let lease = job::claim(&pool, id, Duration::from_secs(5)).await.unwrap();
    let renewed = job::heartbeat(&pool, &lease, Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(renewed.expires_at > lease.expires_at + time::Duration::minutes(30));
    assert_eq!(renewed.token, lease.token);
    assert_eq!(reaper(&pool).run_once().await.unwrap().returned, 0);
    job::complete(&pool, &renewed, &json!(null)).await.unwrap();
    assert_eq!(status(&pool, id).await, JobStatus::Completed);
}

/// `attempts` is an `integer`, counted up in SQL. A job allowed
/// `i32::MAX` attempts whose count was set to the largest (by hand: no
/// failure takes a live job there) made `attempts + 1` overflow (SQLSTATE
/// 22003): each reaper pass failed whole, so every lease expiring after
/// that job's was left processing for good, and `fail` under its lease
/// was a database error. The count stops at the largest integer now: the
/// job is dead, and the pass goes on.
#[tokio::test]
async fn a_job_at_the_largest_attempt_count_neither_stops_the_reaper_nor_fails_fail() {
    let (_db, pool) = setup().await;
    let at_the_largest = async || {
        let id = new_job(&pool, i32::MAX).await;
        let lease = job::claim(&pool, id, LEASE).await.unwrap();
        sqlx::query("UPDATE pgonce.jobs SET attempts = $2 WHERE id = $1")
            .bind(id)
            .bind(i32::MAX)
            .execute(&pool)
            .await
            .unwrap();
        lease
    };
    let poisoned = at_the_largest().await;
    let later = new_job(&pool, 5).await;
    job::claim(&pool, later, LEASE).await.unwrap();
    expire_lease(&pool, poisoned.job_id).await;
    expire_lease(&pool, later).await;
    sqlx::query("UPDATE pgonce.jobs SET lease_expires_at = lease_expires_at + interval '1 ms' WHERE id = $1")
        .bind(later)
        .execute(&pool)
        .await
        .unwrap();
    let counts = reaper(&pool).run_once().await.unwrap();
    assert_eq!((counts.returned, counts.dead), (1, 1));
    let row = job::get(&pool, poisoned.job_id).await.unwrap().unwrap();
    assert_eq!(
        (row.status().unwrap(), row.attempts),
        (JobStatus::Dead, i32::MAX)
    );
    assert_eq!(status(&pool, later).await, JobStatus::Pending);

    let lease = at_the_largest().await;
    let out = job::fail(&pool, &lease, "boom", &RetryPolicy::default()).await;
    assert_eq!(out.unwrap(), FailOutcome::Dead { attempts: i32::MAX });
}

#[tokio::test]
async fn the_reaper_returns_expired_leases_and_kills_jobs_past_max_attempts() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 2).await;
    let live = new_job(&pool, 2).await;
    job::claim(&pool, live, LEASE).await.unwrap();
    for round in 1..=2 {
        job::claim(&pool, id, LEASE).await.unwrap();
        expire_lease(&pool, id).await;
        let counts = reaper(&pool).run_once().await.unwrap();
        if round == 1 {
            assert_eq!((counts.returned, counts.dead), (1, 0));
            assert_eq!(status(&pool, id).await, JobStatus::Pending);
        } else {
            assert_eq!((counts.returned, counts.dead), (0, 1));
        }
    }
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(row.status, "dead");
    assert_eq!(row.attempts, 2);
    assert!(
        row.last_error.unwrap().contains("lease expired"),
        "the reason is recorded"
    );
    assert_eq!(
        status(&pool, live).await,
        JobStatus::Processing,
        "a live lease is left alone"
    );
}

#[tokio::test]
async fn a_failure_is_retried_with_backoff_by_the_redriver_then_dead_at_max_attempts() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 3).await;
    let policy = RetryPolicy {
        base: Duration::from_secs(10),
        max: Duration::from_secs(15),
        jitter: 0.5,
    };
    let redriver = Redriver::new(pool.clone(), RedriverConfig::default()).unwrap();
    let mut delays = Vec::new();
    for attempt in 1..=2 {
        let lease = job::claim(&pool, id, LEASE).await.unwrap();
        let before = time::OffsetDateTime::now_utc();
        let outcome = job::fail(&pool, &lease, "model timed out", &policy)
            .await
            .unwrap();
        let FailOutcome::Retry { attempts, run_at } = outcome else {
            panic!("expected a retry, got {outcome:?}");
        };
        assert_eq!(attempts, attempt);
        delays.push((run_at - before).as_seconds_f64());
        assert_eq!(status(&pool, id).await, JobStatus::Failed);
        assert!(
            matches!(
                job::claim(&pool, id, LEASE).await,
                Err(Error::JobBusy { status: JobStatus::Failed, not_before, .. })
                    if not_before == run_at
            ),
            "a failed job is not claimable before it is re-driven, and not done"
        );
        assert_eq!(
            redriver.run_once().await.unwrap().redriven,
            0,
            "not due yet"
        );
        sqlx::query("UPDATE pgonce.jobs SET run_at = now() - interval '1 ms' WHERE id = $1")
            .bind(id)
            .execute(&pool)
            .await
            .unwrap();
        let counts = redriver.run_once().await.unwrap();
        assert_eq!(counts.ids, vec![id]);
        assert_eq!(status(&pool, id).await, JobStatus::Pending);
    }
    // 10 s then 20 s capped at 15 s, each plus up to 50 % jitter.
    assert!((9.0..=15.5).contains(&delays[0]), "{delays:?}");
    assert!((14.0..=23.0).contains(&delays[1]), "{delays:?}");
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    let outcome = job::fail(&pool, &lease, "still down", &policy)
        .await
        .unwrap();
    assert_eq!(outcome, FailOutcome::Dead { attempts: 3 });
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(row.status, "dead");
    assert_eq!(row.last_error.as_deref(), Some("still down"));
}

/// A job allowed thousands of attempts keeps failing cleanly: the backoff's
/// exponent stops growing long before float8 overflows (it used to raise
/// "value out of range" from attempt ~1,024 on, leaving the job claimed and
/// its error unrecorded). A policy whose max no interval can hold is refused.
#[tokio::test]
async fn the_backoff_never_overflows_and_an_absurd_max_is_refused() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5000).await;
    sqlx::query("UPDATE pgonce.jobs SET attempts = 2000 WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    let policy = RetryPolicy::default();
    let before = time::OffsetDateTime::now_utc();
    let outcome = job::fail(&pool, &lease, "down again", &policy)
        .await
        .unwrap();
    let FailOutcome::Retry { attempts, run_at } = outcome else {
        panic!("expected a retry, got {outcome:?}");
    };
    assert_eq!(attempts, 2001);
    let delay = (run_at - before).as_seconds_f64();
    assert!(
        (599.0..=751.0).contains(&delay),
        "capped at max + jitter: {delay}"
    );

    for max in [Duration::MAX, RetryPolicy::LONGEST + Duration::from_secs(1)] {
        let absurd = RetryPolicy { max, ..policy };
        assert!(
            matches!(absurd.validate(), Err(Error::Invalid { .. })),
            "{max:?}"
        );
    }
}

#[tokio::test]
async fn attempts_are_incremented_in_sql_so_concurrent_failures_are_not_lost() {
    // Two jobs failing through two connections at once: each increments its
    // own row; and the same job's fail can only apply once per lease.
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 10).await;
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    let p = RetryPolicy::default();
    let (a, b) = tokio::join!(
        job::fail(&pool, &lease, "a", &p),
        job::fail(&pool, &lease, "b", &p)
    );
    assert_eq!(
        a.is_ok() as u8 + b.is_ok() as u8,
        1,
        "one fail per lease: {a:?} {b:?}"
    );
    assert_eq!(job::get(&pool, id).await.unwrap().unwrap().attempts, 1);
}

#[tokio::test]
async fn repeatable_read_loser_gets_40001_then_job_busy_on_retry() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(
        &a,
        "claim",
        job::claim(&mut *tx_a, id, Duration::from_secs(60)),
    )
    .await
    .unwrap()
    .unwrap();
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "claim under REPEATABLE READ", async move {
            let mut tx = pgonce::begin(&pool_b, IsolationLevel::RepeatableRead).await?;
            let out = job::claim(&mut *tx, id, Duration::from_secs(60)).await;
            let _ = tx.rollback().await;
            out
        })
        .await
        .unwrap();
    race.step(&a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    let first = waiting.resume().await.unwrap();
    assert!(
        matches!(&first, Err(e @ Error::SerializationFailure { .. }) if e.is_retryable()),
        "{first:?}"
    );
    // The documented remedy: run the transaction again.
    let mut tx = pgonce::begin(b.pool(), IsolationLevel::RepeatableRead)
        .await
        .unwrap();
    let retry = job::claim(&mut *tx, id, Duration::from_secs(60)).await;
    assert!(
        matches!(
            retry,
            Err(Error::JobBusy {
                status: JobStatus::Processing,
                ..
            })
        ),
        "{retry:?}"
    );
}

#[tokio::test]
async fn a_connection_killed_in_the_middle_of_a_claim_loses_neither_the_job_nor_the_claim() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();

    // A claims inside its transaction and dies before COMMIT.
    let mut tx_a = a.pool().begin().await.unwrap();
    let a_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx_a)
        .await
        .unwrap();
    race.step(&a, "claim (uncommitted)", job::claim(&mut *tx_a, id, LEASE))
        .await
        .unwrap()
        .unwrap();
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(
            &b,
            "claim",
            async move { job::claim(&pool_b, id, LEASE).await },
        )
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(a_pid)
        .execute(&pool)
        .await
        .unwrap();
    race.note(&a, "connection killed");
    let b_lease = waiting.resume().await.unwrap().expect("B claims the job");
    drop(tx_a);

    // B commits its claim and then its connection is killed too: the claim
    // is durable, the job stays processing until the reaper returns it.
    kill_session(&pool, &b).await;
    assert_eq!(status(&pool, id).await, JobStatus::Processing);
    expire_lease(&pool, id).await;
    assert_eq!(reaper(&pool).run_once().await.unwrap().returned, 1);
    let c = job::claim(&pool, id, LEASE).await.unwrap();
    job::complete(&pool, &c, &json!("done")).await.unwrap();
    assert!(matches!(
        job::complete(&pool, &b_lease, &json!("late")).await,
        Err(Error::LeaseLost { .. })
    ));
    assert_eq!(status(&pool, id).await, JobStatus::Completed);
}

#[tokio::test]
async fn concurrent_batch_claims_take_every_job_exactly_once() {
    let (_db, pool) = setup().await;
    for i in 0..300 {
        job::enqueue(&pool, &NewJob::new("batch", json!(i)))
            .await
            .unwrap();
    }
    let mut workers = Vec::new();
    for _ in 0..6 {
        let pool = pool.clone();
        workers.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let jobs = job::claim_batch(&pool, "batch", 7, LEASE).await.unwrap();
                if jobs.is_empty() {
                    return mine;
                }
                for j in jobs {
                    job::complete(&pool, &j.lease, &json!("ok")).await.unwrap();
                    mine.push(j.lease.job_id);
                }
            }
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let unique: HashSet<i64> = all.iter().copied().collect();
    assert_eq!(all.len(), 300, "no job claimed twice");
    assert_eq!(unique.len(), 300, "no job missed");
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgonce.jobs WHERE status = 'completed'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(completed, 300);
}

#[tokio::test]
async fn bad_input_is_a_typed_error_and_writes_nothing() {
    let (_db, pool) = setup().await;
    assert!(matches!(
        job::enqueue(&pool, &NewJob::new("", json!(1))).await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        job::enqueue(&pool, &NewJob::new("k", json!(1)).max_attempts(0)).await,
        Err(Error::Invalid { .. })
    ));
    // A payload no claim could read back: nested deeper than serde_json
    // parses (stored, it would fail every claim that picked it), or a NUL.
    let mut too_deep = json!(1);
    for _ in 0..=pgonce::json::MAX_JSON_NESTING {
        too_deep = json!([too_deep]);
    }
    for payload in [too_deep.clone(), json!({"k": "a\u{0}b"})] {
        assert!(matches!(
            job::enqueue(&pool, &NewJob::new("k", payload)).await,
            Err(Error::Invalid { .. })
        ));
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    let id = new_job(&pool, 5).await;
    assert!(matches!(
        job::transition(
            &pool,
            id,
            JobStatus::Processing,
            JobStatus::Completed,
            None,
            None
        )
        .await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        job::claim(&pool, id, Duration::ZERO).await,
        Err(Error::Invalid { .. })
    ));
    let bad = RetryPolicy {
        jitter: 2.0,
        ..RetryPolicy::default()
    };
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    assert!(matches!(
        job::fail(&pool, &lease, "x", &bad).await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        job::complete(&pool, &lease, &too_deep).await,
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        job::complete_many(&pool, &[(lease.clone(), too_deep)]).await,
        Err(Error::Invalid { .. })
    ));
    assert_eq!(status(&pool, id).await, JobStatus::Processing);
    assert!(
        Reaper::new(
            pool.clone(),
            ReaperConfig {
                batch_size: 0,
                ..Default::default()
            }
        )
        .is_err()
    );
    assert!(matches!(
        Redriver::new(
            pool.clone(),
            RedriverConfig {
                hand_on_timeout: Duration::ZERO,
                ..Default::default()
            }
        ),
        Err(Error::Invalid { .. })
    ));
}

/// A lease's end is read back after the claim commits, and a timestamp
/// past year 9999 cannot be: a longer lease would leave the job processing
/// under a token nobody received. Claims and heartbeats past
/// `job::MAX_LEASE` are refused with nothing written; `MAX_LEASE` itself
/// reads back.
#[tokio::test]
async fn a_lease_longer_than_the_longest_is_refused_and_writes_nothing() {
    let (_db, pool) = setup().await;
    let too_long = job::MAX_LEASE + Duration::from_secs(1);
    let eons = Duration::from_secs(8_000 * 365 * 24 * 3600);
    let id = new_job(&pool, 3).await;
    for lease_for in [too_long, eons] {
        assert!(matches!(
            job::claim(&pool, id, lease_for).await,
            Err(Error::Invalid { .. })
        ));
        assert!(matches!(
            job::claim_batch(&pool, "send", 10, lease_for).await,
            Err(Error::Invalid { .. })
        ));
    }
    assert_eq!(status(&pool, id).await, JobStatus::Pending);
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    for extend_by in [too_long, eons] {
        assert!(matches!(
            job::heartbeat(&pool, &lease, extend_by).await,
            Err(Error::Invalid { .. })
        ));
    }
    let stored = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(stored.lease_expires_at, Some(lease.expires_at));
    let longest = job::heartbeat(&pool, &lease, job::MAX_LEASE).await.unwrap();
    let stored = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(stored.lease_expires_at, Some(longest.expires_at));
    job::complete(&pool, &longest, &json!("done"))
        .await
        .unwrap();
}

/// Whether job `id`'s lease has run out by this statement: what the
/// reaper asks.
async fn lease_run_out(pool: &PgPool, id: i64) -> bool {
    sqlx::query_scalar("SELECT lease_expires_at < now() FROM pgonce.jobs WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A lease shorter than half a microsecond rounds to zero in PostgreSQL's
/// `interval`: the claim handed back a lease that had run out as it was
/// taken, and the reaper could give the job to a second worker while the
/// first ran it. Claims and heartbeats below `job::MIN_LEASE` are refused
/// with nothing written; `MIN_LEASE` itself ends after its claim.
#[tokio::test]
async fn a_lease_shorter_than_the_shortest_is_refused_and_writes_nothing() {
    let (_db, pool) = setup().await;
    let too_short = [
        Duration::from_nanos(1),
        Duration::from_nanos(400),
        Duration::from_micros(999),
    ];
    let id = new_job(&pool, 3).await;
    for lease_for in too_short {
        let claimed = job::claim(&pool, id, lease_for).await;
        if claimed.is_ok() {
            panic!(
                "a lease of {lease_for:?} was taken; run out by the next statement: {}",
                lease_run_out(&pool, id).await
            );
        }
        assert!(matches!(claimed, Err(Error::Invalid { .. })), "{claimed:?}");
        assert!(matches!(
            job::claim_batch(&pool, "send", 10, lease_for).await,
            Err(Error::Invalid { .. })
        ));
    }
    assert_eq!(status(&pool, id).await, JobStatus::Pending);
    let lease = job::claim(&pool, id, Duration::from_millis(1))
        .await
        .unwrap();
    let lasts: bool = sqlx::query_scalar(
        "SELECT lease_expires_at >= claimed_at + interval '1 ms' FROM pgonce.jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(lasts);
    for extend_by in too_short {
        assert!(matches!(
            job::heartbeat(&pool, &lease, extend_by).await,
            Err(Error::Invalid { .. })
        ));
    }
    let stored = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(stored.lease_expires_at, Some(lease.expires_at));
}

/// A lease runs from the statement that takes or extends it, not from the
/// start of its transaction: run in a transaction that has been open for
/// two seconds, a claim, a batch claim and a heartbeat of one second each
/// end a second after they ran. (They used to end a second after the
/// transaction began, already past, and the reaper would take the job
/// from a worker still holding it once that transaction committed.)
#[tokio::test]
async fn a_lease_taken_late_in_a_long_transaction_runs_from_the_statement() {
    let (_db, pool) = setup().await;
    let one_second = Duration::from_secs(1);
    let (claimed, batched) = (new_job(&pool, 3).await, new_job(&pool, 3).await);
    sqlx::query("UPDATE pgonce.jobs SET kind = 'batch' WHERE id = $1")
        .bind(batched)
        .execute(&pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    // Time passing inside the transaction is what this is about.
    sqlx::query("SELECT pg_sleep(2)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let lease = job::claim(&mut *tx, claimed, one_second).await.unwrap();
    let batch = job::claim_batch(&mut *tx, "batch", 1, one_second)
        .await
        .unwrap();
    let renewed = job::heartbeat(&mut *tx, &lease, one_second).await.unwrap();
    let begun: time::OffsetDateTime = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let not_before = begun + time::Duration::seconds(3);
    for expires_at in [
        lease.expires_at,
        batch[0].lease.expires_at,
        renewed.expires_at,
    ] {
        assert!(expires_at >= not_before, "{expires_at} < {not_before}");
    }
}

/// A retry's backoff runs from the statement that records the failure,
/// not from the start of its transaction: a failure recorded in a
/// transaction that has been open for a second, with a backoff of exactly
/// one second, is due a second after it ran. (It was due a second after
/// the transaction began, so a failure recorded later than its backoff in
/// a long transaction was due at once, and the redriver ran it again
/// without waiting.)
#[tokio::test]
async fn a_retry_recorded_late_in_a_long_transaction_waits_its_whole_backoff() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 3).await;
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    let one_second = RetryPolicy {
        base: Duration::from_secs(1),
        max: Duration::from_secs(1),
        jitter: 0.0,
    };
    let mut tx = pool.begin().await.unwrap();
    // Time passing inside the transaction is what this is about.
    sqlx::query("SELECT pg_sleep(1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let outcome = job::fail(&mut *tx, &lease, "boom", &one_second)
        .await
        .unwrap();
    let begun: time::OffsetDateTime = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let FailOutcome::Retry { run_at, .. } = outcome else {
        panic!("{outcome:?}");
    };
    let not_before = begun + time::Duration::seconds(2);
    assert!(run_at >= not_before, "{run_at} < {not_before}");
    assert_eq!(job::get(&pool, id).await.unwrap().unwrap().run_at, run_at);
}

/// `transition` stores its result as `complete` does, so it refuses what
/// could not be read back: nested past `MAX_JSON_NESTING` (every later read
/// of the job would fail), or a NUL. The job stays where it was.
#[tokio::test]
async fn a_transition_refuses_a_result_it_could_not_read_back() {
    let (_db, pool) = setup().await;
    let mut too_deep = json!(1);
    for _ in 0..=pgonce::json::MAX_JSON_NESTING {
        too_deep = json!([too_deep]);
    }
    let id = new_job(&pool, 3).await;
    for result in [too_deep, json!({"a\u{0}": 1})] {
        assert!(matches!(
            job::transition(
                &pool,
                id,
                JobStatus::Pending,
                JobStatus::Completed,
                Some(&result),
                None
            )
            .await,
            Err(Error::Invalid { .. })
        ));
    }
    assert_eq!(status(&pool, id).await, JobStatus::Pending);
}

/// A payload written around `enqueue` (raw SQL) that no claim can read back
/// does not take its batch down: `claim_batch` returns the healthy jobs it
/// claimed with it, and only the unreadable one goes the way of a job whose
/// worker died (reaped, then dead at its maximum attempts).
#[tokio::test]
async fn an_unreadable_payload_does_not_hold_back_the_jobs_claimed_with_it() {
    let (_db, pool) = setup().await;
    let healthy = [new_job(&pool, 2).await, new_job(&pool, 2).await];
    let depth = pgonce::json::MAX_JSON_NESTING + 3;
    let poison: i64 = sqlx::query_scalar(
        "INSERT INTO pgonce.jobs (kind, payload, max_attempts) VALUES ('send', $1::jsonb, 2) \
         RETURNING id",
    )
    .bind(format!("{}1{}", "[".repeat(depth), "]".repeat(depth)))
    .fetch_one(&pool)
    .await
    .unwrap();
    let claimed = job::claim_batch(&pool, "send", 10, LEASE).await.unwrap();
    let ids: HashSet<i64> = claimed.iter().map(|c| c.lease.job_id).collect();
    assert_eq!(ids, HashSet::from(healthy));
    for c in &claimed {
        job::complete(&pool, &c.lease, &json!("sent"))
            .await
            .unwrap();
    }
    // The unreadable job was claimed by nobody: reaped, claimed again, and
    // dead at its second lost lease.
    let poison_status = async || -> (String, i32) {
        sqlx::query_as("SELECT status, attempts FROM pgonce.jobs WHERE id = $1")
            .bind(poison)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(poison_status().await, ("processing".to_string(), 0));
    expire_lease(&pool, poison).await;
    reaper(&pool).run_once().await.unwrap();
    assert_eq!(poison_status().await, ("pending".to_string(), 1));
    assert!(
        job::claim_batch(&pool, "send", 10, LEASE)
            .await
            .unwrap()
            .is_empty()
    );
    expire_lease(&pool, poison).await;
    reaper(&pool).run_once().await.unwrap();
    assert_eq!(poison_status().await, ("dead".to_string(), 2));
    for id in healthy {
        assert_eq!(status(&pool, id).await, JobStatus::Completed);
    }
}

/// An operator can read a job whose payload or result cannot be read back
/// (nested past `MAX_JSON_NESTING`, written around `enqueue` and
/// `complete`): `get` returns the row, with each such value as the
/// `UnreadableJson` it is (its text, and why it does not read back), and
/// the rest of the row as stored. (`get` failed, so such a job could not
/// be inspected.)
#[tokio::test]
async fn a_job_whose_payload_cannot_be_read_back_can_still_be_inspected() {
    let (_db, pool) = setup().await;
    let depth = pgonce::json::MAX_JSON_NESTING + 3;
    let deep = format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO pgonce.jobs (kind, payload) VALUES ('send', $1::jsonb) RETURNING id",
    )
    .bind(&deep)
    .fetch_one(&pool)
    .await
    .unwrap();
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!((row.id, row.kind.as_str()), (id, "send"));
    assert_eq!(row.status().unwrap(), JobStatus::Pending);
    let unreadable = row.payload.unwrap_err();
    assert_eq!(unreadable.text, deep);
    assert!(unreadable.why.contains("recursion limit"), "{unreadable}");
    assert_eq!(row.result, None);

    // A readable payload with an unreadable result.
    let done = new_job(&pool, 1).await;
    sqlx::query(
        "UPDATE pgonce.jobs SET status = 'completed', finished_at = now(), result = $2::jsonb \
         WHERE id = $1",
    )
    .bind(done)
    .bind(&deep)
    .execute(&pool)
    .await
    .unwrap();
    let row = job::get(&pool, done).await.unwrap().unwrap();
    assert_eq!(row.payload, Ok(json!({"to": "x"})));
    assert_eq!(row.status().unwrap(), JobStatus::Completed);
    assert_eq!(row.result.unwrap().unwrap_err().text, deep);
}

/// `pgonce_job_claimed_total` counts the jobs a batch claim hands back,
/// not a job whose payload cannot be read back: that one is counted in
/// `pgonce_job_payload_unreadable_total` and left to the reaper. (It was
/// counted in both.) The test runtime is single-threaded, so a
/// thread-local recorder sees every increment.
#[tokio::test(flavor = "current_thread")]
async fn a_batch_counts_as_claimed_only_the_jobs_it_hands_back() {
    let (_db, pool) = setup().await;
    for _ in 0..2 {
        new_job(&pool, 2).await;
    }
    let depth = pgonce::json::MAX_JSON_NESTING + 3;
    sqlx::query("INSERT INTO pgonce.jobs (kind, payload) VALUES ('send', $1::jsonb)")
        .bind(format!("{}1{}", "[".repeat(depth), "]".repeat(depth)))
        .execute(&pool)
        .await
        .unwrap();
    let claimed = Arc::new(AtomicU64::new(0));
    let unreadable = Arc::new(AtomicU64::new(0));
    let recorder = support::OnCounter(|key: &metrics::Key| match key.name() {
        "pgonce_job_claimed_total" => metrics::Counter::from_arc(Arc::clone(&claimed)),
        "pgonce_job_payload_unreadable_total" => {
            metrics::Counter::from_arc(Arc::clone(&unreadable))
        }
        _ => metrics::Counter::noop(),
    });
    let batch = {
        let _local = metrics::set_default_local_recorder(&recorder);
        job::claim_batch(&pool, "send", 10, LEASE).await.unwrap()
    };
    assert_eq!(batch.len(), 2);
    assert_eq!(unreadable.load(Ordering::SeqCst), 1);
    assert_eq!(claimed.load(Ordering::SeqCst), 2);
}

mod state_machine {
    //! Random sequences of calls never reach an illegal state or lose a job.

    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Claim(usize),
        ClaimBatch,
        Complete(usize),
        Fail(usize),
        Heartbeat(usize),
        Expire(usize),
        Reap,
        /// The failed job's backoff passes and the re-driver runs.
        MakeDue(usize),
        Cancel(usize),
        /// An operator retries the job (refused unless it is dead).
        RetryDead(usize),
    }

    /// Weighted so that the long paths (claim, fail, retry, claim, fail to
    /// dead; claim, expire, reap) come up often in few cases.
    fn op() -> impl Strategy<Value = Op> {
        let j = 0..3usize;
        prop_oneof![
            3 => j.clone().prop_map(Op::Claim),
            1 => Just(Op::ClaimBatch),
            2 => j.clone().prop_map(Op::Complete),
            3 => j.clone().prop_map(Op::Fail),
            1 => j.clone().prop_map(Op::Heartbeat),
            2 => j.clone().prop_map(Op::Expire),
            2 => Just(Op::Reap),
            3 => j.clone().prop_map(Op::MakeDue),
            1 => j.clone().prop_map(Op::Cancel),
            1 => j.prop_map(Op::RetryDead),
        ]
    }

    /// Runs `ops` on three fresh jobs of their own kind; checks invariants
    /// after every step. Leases are kept per job, including stale ones, so
    /// late calls with old leases are exercised too.
    async fn run(pool: &PgPool, case: u64, ops: Vec<Op>) -> Result<(), String> {
        let kind = format!("prop-{case}");
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(
                job::enqueue(pool, &NewJob::new(&kind, json!(null)).max_attempts(2))
                    .await
                    .map_err(|e| e.to_string())?,
            );
        }
        let mut leases: Vec<Vec<job::Lease>> = vec![Vec::new(); 3];
        let mut completed_by: Vec<Option<uuid::Uuid>> = vec![None; 3];
        let policy = RetryPolicy {
            base: Duration::from_millis(1),
            max: Duration::from_millis(2),
            jitter: 0.0,
        };
        let mut prev: Vec<(JobStatus, i32)> = vec![(JobStatus::Pending, 0); 3];
        for op in ops {
            let mut revived = None;
            match op {
                Op::Claim(j) => {
                    if let Ok(l) = job::claim(pool, ids[j], LEASE).await {
                        leases[j].push(l);
                    }
                }
                Op::ClaimBatch => {
                    for c in job::claim_batch(pool, &kind, 2, LEASE).await.unwrap() {
                        let j = ids.iter().position(|&i| i == c.lease.job_id).unwrap();
                        leases[j].push(c.lease);
                    }
                }
                Op::Complete(j) => {
                    // Try the newest lease, then the stale ones.
                    for l in leases[j].iter().rev() {
                        if job::complete(pool, l, &json!(l.token)).await.is_ok() {
                            if completed_by[j].is_some() {
                                return Err(format!("job {j} completed twice"));
                            }
                            completed_by[j] = Some(l.token);
                        }
                    }
                }
                Op::Fail(j) => {
                    if let Some(l) = leases[j].last() {
                        let _ = job::fail(pool, l, "boom", &policy).await;
                    }
                }
                Op::Heartbeat(j) => {
                    if let Some(l) = leases[j].first() {
                        let _ = job::heartbeat(pool, l, LEASE).await;
                    }
                }
                Op::Expire(j) => expire_lease(pool, ids[j]).await,
                Op::Reap => {
                    reaper(pool).run_once().await.unwrap();
                }
                Op::MakeDue(j) => {
                    sqlx::query("UPDATE pgonce.jobs SET run_at = now() - interval '1 ms' WHERE id = $1 AND status = 'failed'")
                        .bind(ids[j])
                        .execute(pool)
                        .await
                        .unwrap();
                    Redriver::new(pool.clone(), RedriverConfig::default())
                        .unwrap()
                        .run_once()
                        .await
                        .unwrap();
                }
                Op::Cancel(j) => {
                    let _ = job::transition(
                        pool,
                        ids[j],
                        JobStatus::Pending,
                        JobStatus::Dead,
                        None,
                        Some("cancelled"),
                    )
                    .await;
                }
                Op::RetryDead(j) => {
                    let mut conn = pool.acquire().await.unwrap();
                    let by = job::RetryBy {
                        who: "prop",
                        reason: None,
                    };
                    match job::retry_dead(&mut conn, ids[j], by).await {
                        Ok(()) if prev[j].0 == JobStatus::Dead => revived = Some(j),
                        Err(Error::JobNotDead {
                            status: Some(s), ..
                        }) if s == prev[j].0 => {}
                        other => return Err(format!("job {j} was {}: retry {other:?}", prev[j].0)),
                    }
                }
            }
            for (j, &id) in ids.iter().enumerate() {
                let Some(row) = job::get(pool, id).await.unwrap() else {
                    return Err(format!("job {j} lost"));
                };
                let s = row.status().map_err(|e| e.to_string())?;
                let (was, attempts_before) = prev[j];
                if revived == Some(j) {
                    if s != JobStatus::Pending || row.attempts != 0 {
                        return Err(format!("job {j} retried to {s}, {} attempts", row.attempts));
                    }
                    prev[j] = (s, 0);
                    continue;
                }
                if was.is_terminal() && s != was {
                    return Err(format!("job {j} left terminal {was} for {s}"));
                }
                if row.attempts < attempts_before || row.attempts > row.max_attempts {
                    return Err(format!("job {j} attempts {} out of range", row.attempts));
                }
                if (s == JobStatus::Processing) != row.lease_token.is_some() {
                    return Err(format!("job {j}: lease without processing or the reverse"));
                }
                if s == JobStatus::Completed && row.result != completed_by[j].map(|t| Ok(json!(t)))
                {
                    return Err(format!("job {j}: result not from its completing lease"));
                }
                if row.attempts == row.max_attempts && !s.is_terminal() {
                    return Err(format!("job {j} at max attempts but {s}"));
                }
                prev[j] = (s, row.attempts);
            }
        }
        Ok(())
    }

    #[test]
    fn no_sequence_of_calls_reaches_an_illegal_state_or_loses_a_job() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (db, pool) = rt.block_on(setup());
        let case = std::sync::atomic::AtomicU64::new(0);
        proptest!(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() },
        |(ops in proptest::collection::vec(op(), 1..40))| {
            let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let out = rt.block_on(run(&pool, n, ops));
            prop_assert!(out.is_ok(), "{}", out.unwrap_err());
        });
        let retried: i64 = rt
            .block_on(
                sqlx::query_scalar("SELECT count(*) FROM pgonce.job_retries").fetch_one(&pool),
            )
            .unwrap();
        assert!(retried > 0, "the cases revived some dead job");
        drop(db);
    }
}

#[tokio::test]
async fn complete_many_completes_each_job_only_under_its_current_lease() {
    let (_db, pool) = setup().await;
    for i in 0..3 {
        job::enqueue(&pool, &NewJob::new("many", json!(i)))
            .await
            .unwrap();
    }
    let claimed = job::claim_batch(&pool, "many", 3, LEASE).await.unwrap();
    assert_eq!(claimed.len(), 3);
    // The first job's lease is taken over before the batch completes.
    let taken = claimed[0].lease.job_id;
    expire_lease(&pool, taken).await;
    reaper(&pool).run_once().await.unwrap();
    let new = job::claim(&pool, taken, LEASE).await.unwrap();
    let done: Vec<_> = claimed
        .iter()
        .map(|c| (c.lease.clone(), json!("batch")))
        .collect();
    let lost = job::complete_many(&pool, &done).await.unwrap();
    assert_eq!(lost, vec![taken]);
    assert_eq!(status(&pool, taken).await, JobStatus::Processing);
    for c in &claimed[1..] {
        assert_eq!(status(&pool, c.lease.job_id).await, JobStatus::Completed);
    }
    job::complete(&pool, &new, &json!("new")).await.unwrap();
}

/// A stale lease handed to `complete_many` beside its job's current lease
/// is lost, not completed: the current one completes the job, the stale
/// one's caller is told it lost (so it rolls back its side effect).
#[tokio::test]
async fn complete_many_reports_a_stale_lease_lost_beside_the_current_one() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let stale = job::claim(&pool, id, LEASE).await.unwrap();
    expire_lease(&pool, id).await;
    reaper(&pool).run_once().await.unwrap();
    let current = job::claim(&pool, id, LEASE).await.unwrap();
    let done = [(current.clone(), json!("current")), (stale, json!("stale"))];
    let lost = job::complete_many(&pool, &done).await.unwrap();
    assert_eq!(lost, vec![id]);
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(row.result, Some(Ok(json!("current"))));
}

/// One lease handed to `complete_many` twice, with two results, completes
/// the job once, with one of them: the caller would be told both
/// completions were written. Refused instead, with nothing written.
#[tokio::test]
async fn complete_many_refuses_one_lease_twice_and_writes_nothing() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    let done = [(lease.clone(), json!(1)), (lease.clone(), json!(2))];
    let out = job::complete_many(&pool, &done).await;
    assert!(matches!(out, Err(Error::Invalid { .. })), "{out:?}");
    assert_eq!(status(&pool, id).await, JobStatus::Processing);
    job::complete(&pool, &lease, &json!(3)).await.unwrap();
}

#[tokio::test]
async fn the_reaper_service_loop_reaps_until_shutdown() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    job::claim(&pool, id, LEASE).await.unwrap();
    expire_lease(&pool, id).await;
    let config = ReaperConfig {
        interval: Duration::from_millis(10),
        ..ReaperConfig::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = tokio::spawn(Reaper::new(pool.clone(), config).unwrap().run(async {
        let _ = stopped.await;
    }));
    // Poll the database for the outcome (no sleep decides anything).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while status(&pool, id).await != JobStatus::Pending {
        assert!(std::time::Instant::now() < deadline, "not reaped");
        tokio::task::yield_now().await;
    }
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(60), service)
        .await
        .expect("run returns on shutdown")
        .unwrap();
}

/// A job failed to death on its only attempt.
async fn dead_job(pool: &PgPool, kind: &str) -> i64 {
    let id = job::enqueue(pool, &NewJob::new(kind, json!(null)).max_attempts(1))
        .await
        .unwrap();
    let lease = job::claim(pool, id, LEASE).await.unwrap();
    let out = job::fail(pool, &lease, "credential revoked", &RetryPolicy::default())
        .await
        .unwrap();
    assert_eq!(out, FailOutcome::Dead { attempts: 1 });
    id
}

const ALICE: job::RetryBy<'static> = job::RetryBy {
    who: "alice",
    reason: Some("credential rotated"),
};

/// A job statement that meets a row another transaction is changing waits
/// for it within the session's lock_timeout (an operator's `ALTER ROLE ...
/// SET lock_timeout`; here set on the session): past it, the typed
/// `LockNotAvailable` with nothing written, not a bare database error a
/// caller cannot tell from a bug. Seen blocked on A's transaction first:
/// an operator's retry (one job, a filtered set) behind a concurrent
/// retry, and a claim and a transition behind a transition. Each gave
/// PostgreSQL's 55P03 as `Error::Database`.
#[tokio::test]
async fn a_wait_past_the_sessions_lock_timeout_is_typed_and_writes_nothing() {
    let (db, pool) = setup().await;
    let dead = dead_job(&pool, "send").await;
    let pending = new_job(&pool, 3).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    b.set("lock_timeout", "1s").await.unwrap();
    let bob = job::RetryBy {
        who: "bob",
        reason: None,
    };

    let mut tx_a = a.pool().begin().await.unwrap();
    race.step(
        &a,
        "retry dead job",
        job::retry_dead(&mut tx_a, dead, ALICE),
    )
    .await
    .unwrap()
    .unwrap();
    race.step(
        &a,
        "complete the pending job",
        job::transition(
            &mut *tx_a,
            pending,
            JobStatus::Pending,
            JobStatus::Completed,
            None,
            None,
        ),
    )
    .await
    .unwrap()
    .unwrap();
    let cases = ["retry_dead", "retry_dead_jobs", "claim", "transition"];
    for case in cases {
        let timeout = ("lock_timeout", Duration::from_secs(1));
        let waited = support::outcome_of_blocked_wait(&race, &b, "A", case, timeout, || {
            let pool_b = b.pool().clone();
            async move {
                let mut conn = pool_b.acquire().await?;
                match case {
                    "retry_dead" => job::retry_dead(&mut conn, dead, bob).await,
                    "retry_dead_jobs" => {
                        job::retry_dead_jobs(&mut conn, &DeadJobFilter::default(), bob)
                            .await
                            .map(drop)
                    }
                    "claim" => job::claim(&mut *conn, pending, LEASE).await.map(drop),
                    _ => {
                        job::transition(
                            &mut *conn,
                            pending,
                            JobStatus::Pending,
                            JobStatus::Dead,
                            None,
                            Some("cancelled"),
                        )
                        .await
                    }
                }
            }
        })
        .await;
        assert!(
            matches!(&waited, Err(Error::LockNotAvailable { .. })),
            "{case}: {waited:?}"
        );
    }
    race.step(&a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let audit = job::retries(&mut conn, dead).await.unwrap();
    assert_eq!(audit.len(), 1, "A's retry alone: {audit:?}");
    assert_eq!(audit[0].retried_by, "alice");
    let row = job::get(&pool, pending).await.unwrap().unwrap();
    assert_eq!(row.status.as_str(), "completed", "A's transition alone");
    assert_eq!(row.last_error, None);
}

/// Once its cause is fixed, a dead job is retried by an operator. Two
/// operators retrying it at once: one retries (one audit row), the other is
/// refused as the job is no longer dead. Two workers then race for it: it
/// runs exactly once.
#[tokio::test]
async fn a_retried_dead_job_runs_exactly_once_under_concurrent_retriers_and_workers() {
    let (db, pool) = setup().await;
    let id = dead_job(&pool, "send").await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();

    let mut tx_a = a.pool().begin().await.unwrap();
    race.step(&a, "retry dead job", job::retry_dead(&mut tx_a, id, ALICE))
        .await
        .unwrap()
        .unwrap();
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "retry dead job", async move {
            let mut conn = pool_b.acquire().await?;
            let by = job::RetryBy {
                who: "bob",
                reason: None,
            };
            job::retry_dead(&mut conn, id, by).await
        })
        .await
        .unwrap();
    let second = commit_a_then_resume(&race, &a, tx_a, waiting).await;
    assert!(
        matches!(
            second,
            Err(Error::JobNotDead {
                job_id,
                status: Some(JobStatus::Pending)
            }) if job_id == id
        ),
        "{second:?}"
    );

    let mut conn = pool.acquire().await.unwrap();
    let audit = job::retries(&mut conn, id).await.unwrap();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].retried_by, "alice");
    assert_eq!(audit[0].reason.as_deref(), Some("credential rotated"));
    assert_eq!(audit[0].previous_attempts, 1);
    assert_eq!(
        audit[0].previous_error.as_deref(),
        Some("credential revoked")
    );
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("pending", 0));

    // Two workers poll at once; the job runs once.
    let (w1, w2) = tokio::join!(
        job::claim_batch(&pool, "send", 10, LEASE),
        job::claim_batch(&pool, "send", 10, LEASE)
    );
    let claimed: Vec<_> = w1.unwrap().into_iter().chain(w2.unwrap()).collect();
    assert_eq!(claimed.len(), 1, "claimed once: {claimed:?}");
    job::complete(&pool, &claimed[0].lease, &json!("sent"))
        .await
        .unwrap();
    assert_eq!(status(&pool, id).await, JobStatus::Completed);
    assert!(
        job::claim_batch(&pool, "send", 10, LEASE)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(job::retries(&mut conn, id).await.unwrap().len(), 1);
}

/// Retrying one job that is not dead is a typed refusal that writes
/// nothing; a filtered retry only ever selects dead jobs (of its kind and
/// death time); bad input is refused before anything is written.
#[tokio::test]
async fn retrying_a_job_that_is_not_dead_is_refused_and_a_filter_takes_only_dead_jobs() {
    let (_db, pool) = setup().await;
    let pending = new_job(&pool, 5).await;
    let processing = new_job(&pool, 5).await;
    job::claim(&pool, processing, LEASE).await.unwrap();
    let failed = new_job(&pool, 5).await;
    let lease = job::claim(&pool, failed, LEASE).await.unwrap();
    job::fail(&pool, &lease, "flaky", &RetryPolicy::default())
        .await
        .unwrap();
    let completed = new_job(&pool, 5).await;
    let lease = job::claim(&pool, completed, LEASE).await.unwrap();
    job::complete(&pool, &lease, &json!(1)).await.unwrap();
    let before: Vec<_> = {
        let mut rows = Vec::new();
        for id in [pending, processing, failed, completed] {
            rows.push(format!("{:?}", job::get(&pool, id).await.unwrap()));
        }
        rows
    };
    let mut conn = pool.acquire().await.unwrap();
    for (id, expected) in [
        (pending, Some(JobStatus::Pending)),
        (processing, Some(JobStatus::Processing)),
        (failed, Some(JobStatus::Failed)),
        (completed, Some(JobStatus::Completed)),
        (9_999, None),
    ] {
        let out = job::retry_dead(&mut conn, id, ALICE).await;
        assert!(
            matches!(&out, Err(Error::JobNotDead { job_id, status }) if *job_id == id && *status == expected),
            "{id}: {out:?}"
        );
    }
    for (i, id) in [pending, processing, failed, completed].iter().enumerate() {
        assert_eq!(
            format!("{:?}", job::get(&pool, *id).await.unwrap()),
            before[i],
            "job {id} untouched"
        );
    }
    let audits: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.job_retries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(audits, 0);

    // Filters: kind and death time; only dead jobs.
    let old_send = dead_job(&pool, "send").await;
    sqlx::query("UPDATE pgonce.jobs SET finished_at = now() - interval '2 days' WHERE id = $1")
        .bind(old_send)
        .execute(&pool)
        .await
        .unwrap();
    let new_send = dead_job(&pool, "send").await;
    let other_kind = dead_job(&pool, "bill").await;
    let since_yesterday = DeadJobFilter {
        kind: Some("send".into()),
        dead_since: Some(time::OffsetDateTime::now_utc() - time::Duration::days(1)),
        ..DeadJobFilter::default()
    };
    let retried = job::retry_dead_jobs(&mut conn, &since_yesterday, ALICE)
        .await
        .unwrap();
    assert_eq!(retried, vec![new_send]);
    assert_eq!(status(&pool, old_send).await, JobStatus::Dead);
    assert_eq!(status(&pool, other_kind).await, JobStatus::Dead);
    assert!(
        job::retry_dead_jobs(&mut conn, &since_yesterday, ALICE)
            .await
            .unwrap()
            .is_empty(),
        "a second pass finds nothing dead"
    );
    let everything = job::retry_dead_jobs(&mut conn, &DeadJobFilter::default(), ALICE)
        .await
        .unwrap();
    assert_eq!(everything, vec![old_send, other_kind]);
    assert_eq!(status(&pool, pending).await, JobStatus::Pending);
    assert_eq!(status(&pool, completed).await, JobStatus::Completed);

    // Bad input: nothing written.
    let nobody = job::RetryBy {
        who: "",
        reason: None,
    };
    let d = dead_job(&pool, "send").await;
    assert!(matches!(
        job::retry_dead(&mut conn, d, nobody).await,
        Err(Error::Invalid { .. })
    ));
    let no_limit = DeadJobFilter {
        limit: 0,
        ..DeadJobFilter::default()
    };
    assert!(matches!(
        job::retry_dead_jobs(&mut conn, &no_limit, ALICE).await,
        Err(Error::Invalid { .. })
    ));
    assert_eq!(status(&pool, d).await, JobStatus::Dead);
}

/// Starts the transaction's snapshot: the first statement of a REPEATABLE
/// READ or SERIALIZABLE transaction takes the snapshot every later one reads.
async fn take_snapshot(tx: &mut sqlx::PgConnection) {
    sqlx::query("SELECT count(*) FROM pgonce.jobs")
        .execute(tx)
        .await
        .unwrap();
}

fn asks_for_a_retry<T: std::fmt::Debug>(what: &str, out: pgonce::Result<T>) {
    assert!(
        matches!(&out, Err(e @ Error::SerializationFailure { .. }) if e.is_retryable()),
        "{what}: {out:?}"
    );
}

/// A worker whose REPEATABLE READ or SERIALIZABLE transaction took its
/// snapshot before the job was claimed (on the pool, by `claim` or
/// `claim_batch`) holds the lease all the same, but that snapshot shows the
/// job pending. Completing, failing or heartbeating in that transaction
/// must ask for the transaction to be retried, not report the lease lost:
/// the worker would acknowledge its message as the docs say, and the job,
/// reaped later, would be pending with no message left to drive it. The
/// retry, under a fresh snapshot, completes the job under the same lease.
/// A lease taken in the transaction itself is seen by it.
#[tokio::test]
async fn a_lease_used_under_a_snapshot_older_than_the_claim_asks_for_a_retry() {
    let (_db, pool) = setup().await;
    for level in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable] {
        for batch in [false, true] {
            let id = new_job(&pool, 5).await;
            let mut txs = Vec::new();
            for _ in 0..4 {
                let mut tx = pgonce::begin(&pool, level).await.unwrap();
                take_snapshot(&mut tx).await;
                txs.push(tx);
            }
            let lease = if batch {
                let claimed = job::claim_batch(&pool, "send", 1, LEASE).await.unwrap();
                assert_eq!(claimed.len(), 1);
                claimed[0].lease.clone()
            } else {
                job::claim(&pool, id, LEASE).await.unwrap()
            };
            assert_eq!(lease.job_id, id);
            let [mut complete, mut fail, mut beat, mut many] = <[_; 4]>::try_from(txs).unwrap();
            asks_for_a_retry(
                "complete",
                job::complete(&mut *complete, &lease, &json!("done")).await,
            );
            asks_for_a_retry(
                "fail",
                job::fail(&mut *fail, &lease, "boom", &RetryPolicy::default()).await,
            );
            asks_for_a_retry("heartbeat", job::heartbeat(&mut *beat, &lease, LEASE).await);
            asks_for_a_retry(
                "complete_many",
                job::complete_many(&mut *many, &[(lease.clone(), json!("done"))]).await,
            );
            for tx in [complete, fail, beat, many] {
                let _ = tx.rollback().await;
            }
            assert_eq!(status(&pool, id).await, JobStatus::Processing);
            // The retry: a fresh snapshot sees the lease.
            let mut tx = pgonce::begin(&pool, level).await.unwrap();
            let lease = job::heartbeat(&mut *tx, &lease, LEASE).await.unwrap();
            job::complete(&mut *tx, &lease, &json!("done"))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            assert_eq!(status(&pool, id).await, JobStatus::Completed, "{level:?}");
        }
        // Claimed in the transaction itself, after its snapshot was taken.
        let id = new_job(&pool, 5).await;
        let mut tx = pgonce::begin(&pool, level).await.unwrap();
        take_snapshot(&mut tx).await;
        let lease = job::claim(&mut *tx, id, LEASE).await.unwrap();
        let lease = job::heartbeat(&mut *tx, &lease, LEASE).await.unwrap();
        job::complete(&mut *tx, &lease, &json!("done"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(status(&pool, id).await, JobStatus::Completed);
    }
}

/// A lease really lost (reaped and claimed by another worker) stays
/// [`Error::LeaseLost`] under REPEATABLE READ and SERIALIZABLE, whether the
/// snapshot sees the takeover or is older than the lost lease itself (then
/// the first attempt asks for a retry, and the retry hears the loss): a
/// lost lease never turns into an endless retry.
#[tokio::test]
async fn a_lease_taken_over_is_lost_under_repeatable_read_too() {
    let (_db, pool) = setup().await;
    for level in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable] {
        let id = new_job(&pool, 5).await;
        let mut older = pgonce::begin(&pool, level).await.unwrap();
        take_snapshot(&mut older).await;
        let lost = job::claim(&pool, id, LEASE).await.unwrap();
        expire_lease(&pool, id).await;
        assert_eq!(reaper(&pool).run_once().await.unwrap().returned, 1);
        let current = job::claim(&pool, id, LEASE).await.unwrap();
        asks_for_a_retry(
            "complete",
            job::complete(&mut *older, &lost, &json!("stale")).await,
        );
        let _ = older.rollback().await;
        let mut tx = pgonce::begin(&pool, level).await.unwrap();
        take_snapshot(&mut tx).await;
        every_write_hears_the_lease_lost(&mut tx, &lost).await;
        tx.rollback().await.unwrap();
        job::complete(&pool, &current, &json!("fresh"))
            .await
            .unwrap();
    }
}

/// A lease whose claim rolled back was never anyone's: no transaction
/// can commit its token any more. Used under a REPEATABLE READ snapshot
/// taken while the claiming transaction was still open (seen holding its
/// transaction id in `pg_locks`, and not ended in the snapshot), it
/// asked for a retry (40001) whose only answer was `LeaseLost`; it is
/// `LeaseLost` at once now, and the caller's transaction goes on.
#[tokio::test]
async fn a_lease_whose_claim_rolled_back_is_lost_at_once_under_an_older_snapshot() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let holder = race.session("holder").await.unwrap();
    let worker = race.session("worker").await.unwrap();
    let mut claiming = holder.pool().begin().await.unwrap();
    let lease = race
        .step(&holder, "claim", job::claim(&mut *claiming, id, LEASE))
        .await
        .unwrap()
        .unwrap();
    let holds_its_id = async || -> bool {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'transactionid' \
             AND granted AND transactionid::text = ($1::bigint % 4294967296)::text)",
        )
        .bind(lease.claimed_in)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert!(holds_its_id().await, "the claim's transaction is open");
    let mut tx = pgonce::begin(worker.pool(), IsolationLevel::RepeatableRead)
        .await
        .unwrap();
    take_snapshot(&mut tx).await;
    let in_progress: bool = sqlx::query_scalar(
        "SELECT NOT pg_visible_in_snapshot($1::text::xid8, pg_current_snapshot())",
    )
    .bind(lease.claimed_in)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert!(in_progress, "the snapshot does not see the claim's end");
    race.step(&holder, "ROLLBACK", claiming.rollback())
        .await
        .unwrap()
        .unwrap();
    assert!(!holds_its_id().await, "the claim's transaction is gone");
    every_write_hears_the_lease_lost(&mut tx, &lease).await;
    tx.commit().await.unwrap();
    assert_eq!(status(&pool, id).await, JobStatus::Pending);
}

/// Completing, failing, heartbeating and completing in a batch under
/// `lost`, in `tx`, each hear the lease is lost, and write nothing.
async fn every_write_hears_the_lease_lost(tx: &mut sqlx::PgConnection, lost: &job::Lease) {
    let out = job::complete(&mut *tx, lost, &json!("stale")).await;
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
    let out = job::fail(&mut *tx, lost, "stale", &RetryPolicy::default()).await;
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
    let out = job::heartbeat(&mut *tx, lost, LEASE).await;
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
    let out = job::complete_many(&mut *tx, &[(lost.clone(), json!("stale"))]).await;
    assert_eq!(out.unwrap(), [lost.job_id]);
}

/// A failure's message is free text from whatever failed, and may hold a
/// NUL character, which PostgreSQL's text cannot: recording the failure
/// must not fail on it (the job would stay processing until reaped, its
/// error unrecorded, and a caller's transaction would be aborted). The NUL
/// is stored as U+FFFD; the same for a transition's error.
#[tokio::test]
async fn a_failure_message_with_a_nul_character_is_recorded() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    let out = job::fail(
        &pool,
        &lease,
        "read \0 from the socket: a\0b",
        &RetryPolicy::default(),
    )
    .await;
    assert!(
        matches!(out, Ok(FailOutcome::Retry { attempts: 1, .. })),
        "{out:?}"
    );
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(
        row.last_error.as_deref(),
        Some("read \u{FFFD} from the socket: a\u{FFFD}b")
    );
    let id = new_job(&pool, 5).await;
    job::transition(
        &pool,
        id,
        JobStatus::Pending,
        JobStatus::Dead,
        None,
        Some("cancelled\0"),
    )
    .await
    .unwrap();
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(row.last_error.as_deref(), Some("cancelled\u{FFFD}"));
}

/// A lease used on another connection before the transaction that claimed
/// it committed: the claim may still commit or roll back, so the write is
/// asked to be retried (the job, as committed, is still pending, and the
/// write waits for nothing), not told the lease is lost. Once the claim
/// commits, the lease completes the job.
#[tokio::test]
async fn a_lease_used_before_its_claim_committed_asks_for_a_retry() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let mut claiming = pool.begin().await.unwrap();
    let lease = job::claim(&mut *claiming, id, LEASE).await.unwrap();
    asks_for_a_retry(
        "complete",
        job::complete(&pool, &lease, &json!("early")).await,
    );
    asks_for_a_retry("heartbeat", job::heartbeat(&pool, &lease, LEASE).await);
    claiming.commit().await.unwrap();
    job::complete(&pool, &lease, &json!("done")).await.unwrap();
    assert_eq!(status(&pool, id).await, JobStatus::Completed);
}

/// A kind PostgreSQL cannot store (NUL, or longer than one entry of the
/// runnable-jobs index once compressed) is refused before anything reaches
/// the database: a database error would abort the caller's transaction.
/// The longest kind accepted, of text that does not compress, is enqueued
/// and claimed.
#[tokio::test]
async fn kinds_postgres_cannot_store_are_refused_before_the_transaction_is_touched() {
    let (_db, pool) = setup().await;
    // Hex of random bytes hardly compresses: 6000 bytes are past the
    // index's 2704, which the longest kind fits whatever its content.
    let random = |bytes: usize| -> String {
        (0..bytes.div_ceil(32))
            .map(|_| uuid::Uuid::new_v4().simple().to_string())
            .collect::<String>()[..bytes]
            .to_string()
    };
    let longest = random(job::MAX_KIND_BYTES);
    let mut tx = pool.begin().await.unwrap();
    for kind in [
        "a\0b".to_string(),
        random(job::MAX_KIND_BYTES + 1),
        random(6000),
    ] {
        let out = job::enqueue(&mut *tx, &NewJob::new(kind.clone(), json!({}))).await;
        assert!(
            matches!(
                out,
                Err(Error::Invalid {
                    what: "job kind",
                    ..
                })
            ),
            "enqueue {} bytes: {out:?}",
            kind.len()
        );
        let out = job::claim_batch(&mut *tx, &kind, 1, LEASE).await;
        assert!(
            matches!(
                out,
                Err(Error::Invalid {
                    what: "job kind",
                    ..
                })
            ),
            "claim_batch {} bytes: {out:?}",
            kind.len()
        );
    }
    // The transaction is intact: the longest kind goes in through it.
    let id = job::enqueue(&mut *tx, &NewJob::new(longest.clone(), json!({})))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let claimed = job::claim_batch(&pool, &longest, 10, LEASE).await.unwrap();
    assert_eq!(
        claimed.iter().map(|c| c.lease.job_id).collect::<Vec<_>>(),
        [id]
    );
    assert_eq!(claimed[0].kind, longest);
}

/// A retry whose operator, reason or kind filter holds NUL (which SQL text
/// cannot) is refused with `Invalid` before any statement, so the caller's
/// transaction goes on, and the job stays dead until a retry it can record.
#[tokio::test]
async fn a_retry_with_text_postgres_cannot_store_is_refused_and_the_job_stays_dead() {
    let (_db, pool) = setup().await;
    let id = dead_job(&pool, "send").await;
    let mut tx = pool.begin().await.unwrap();
    let refused = [
        job::RetryBy {
            who: "al\0ice",
            reason: None,
        },
        job::RetryBy {
            who: "alice",
            reason: Some("re\0try"),
        },
    ];
    for by in refused {
        let out = job::retry_dead(&mut tx, id, by).await;
        assert!(matches!(out, Err(Error::Invalid { .. })), "{by:?}: {out:?}");
    }
    let filter = DeadJobFilter {
        kind: Some("se\0nd".into()),
        ..DeadJobFilter::default()
    };
    let out = job::retry_dead_jobs(&mut tx, &filter, ALICE).await;
    assert!(matches!(out, Err(Error::Invalid { .. })), "{out:?}");
    // Nothing aborted the transaction: the retry it can record goes in.
    job::retry_dead(&mut tx, id, ALICE).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(status(&pool, id).await, JobStatus::Pending);
}

/// A moment given in `offset`, as `time` holds it.
fn at(date: time::Date, clock: time::Time, offset: time::UtcOffset) -> time::OffsetDateTime {
    time::PrimitiveDateTime::new(date, clock).assume_offset(offset)
}

/// The first and last times pgonce stores and reads back: 4714-11-24 BC
/// (Julian day 0, PostgreSQL's first) and the end of 9999 in UTC (the
/// last sqlx decodes).
fn readable_range() -> (time::OffsetDateTime, time::OffsetDateTime) {
    use time::{Date, Month, Time, UtcOffset};
    let earliest = at(
        Date::from_julian_day(0).unwrap(),
        Time::MIDNIGHT,
        UtcOffset::UTC,
    );
    let latest = at(
        Date::from_calendar_date(9999, Month::December, 31).unwrap(),
        Time::from_hms_micro(23, 59, 59, 999_999).unwrap(),
        UtcOffset::UTC,
    );
    (earliest, latest)
}

/// A job's `run_at` and a dead-job filter's bounds are timestamps the caller
/// gives. `time` holds years -9999 to 9999 in any offset; PostgreSQL stores
/// nothing before 4714-11-24 BC (Julian day 0), and a time past the end of
/// 9999 in UTC cannot be read back. Such a time used to be PostgreSQL's
/// "timestamp out of range" (22008), which aborted the caller's transaction,
/// or, for one still in 9999 in its own offset but past it in UTC, a panic
/// inside sqlx's encoding. Both ends are a typed refusal now, before any
/// statement, and the range's own ends are stored and read back equal.
#[tokio::test]
async fn a_time_postgres_cannot_store_or_read_back_is_refused_before_the_transaction_is_touched() {
    use time::{Date, OffsetDateTime, Time, UtcOffset};
    let (_db, pool) = setup().await;
    let (earliest, latest) = readable_range();
    let refused = [
        OffsetDateTime::new_utc(Date::MIN, Time::MIDNIGHT),
        earliest - time::Duration::microseconds(1),
        // Still 9999 where it was written, 10000 in UTC.
        at(
            latest.date(),
            Time::from_hms(23, 0, 0).unwrap(),
            UtcOffset::from_hms(-5, 0, 0).unwrap(),
        ),
    ];
    let id = dead_job(&pool, "send").await;
    let mut tx = pool.begin().await.unwrap();
    for t in refused {
        let mut new = NewJob::new("send", json!({}));
        new.run_at = Some(t);
        let out = job::enqueue(&mut *tx, &new).await;
        assert!(
            matches!(
                &out,
                Err(Error::Invalid {
                    what: "job run_at",
                    ..
                })
            ),
            "{t}: {out:?}"
        );
        for filter in [
            DeadJobFilter {
                dead_since: Some(t),
                ..DeadJobFilter::default()
            },
            DeadJobFilter {
                dead_before: Some(t),
                ..DeadJobFilter::default()
            },
        ] {
            let out = job::retry_dead_jobs(&mut tx, &filter, ALICE).await;
            assert!(
                matches!(
                    &out,
                    Err(Error::Invalid {
                        what: "dead job filter",
                        ..
                    })
                ),
                "{t}: {out:?}"
            );
        }
    }
    // Nothing aborted the transaction: both ends of the range go in, and
    // the filter spanning them retries the dead job.
    let mut stored = Vec::new();
    for t in [earliest, latest] {
        let mut new = NewJob::new("send", json!({}));
        new.run_at = Some(t);
        stored.push((job::enqueue(&mut *tx, &new).await.unwrap(), t));
    }
    let span = DeadJobFilter {
        dead_since: Some(earliest),
        dead_before: Some(latest),
        ..DeadJobFilter::default()
    };
    assert_eq!(
        job::retry_dead_jobs(&mut tx, &span, ALICE).await.unwrap(),
        [id]
    );
    tx.commit().await.unwrap();
    for (id, t) in stored {
        assert_eq!(job::get(&pool, id).await.unwrap().unwrap().run_at, t);
    }
}

/// What a claim of job `id` that must lose says: the job's status and
/// when it can be claimed at the earliest.
async fn busy(pool: &PgPool, id: i64) -> (JobStatus, time::OffsetDateTime) {
    match job::claim(pool, id, LEASE).await {
        Err(Error::JobBusy {
            status, not_before, ..
        }) => (status, not_before),
        other => panic!("job {id}: expected JobBusy, got {other:?}"),
    }
}

/// PostgreSQL's `infinity` and `-infinity` are timestamps an operator may
/// write by hand: `run_at = 'infinity'` parks a job, `'-infinity'` puts it
/// first, `lease_expires_at = 'infinity'` pins a lease. sqlx's decoding of
/// a time past the end of 9999 (or before year -9999) panics, so every
/// read of such a job panicked: a duplicate delivery's claim (the job's
/// state when the claim loses), `get`, and `fail` on the last attempt
/// (which returns the job's `run_at`). Such times now read as the ends of
/// what pgonce reads back, and the job is handled as it says.
#[tokio::test]
async fn times_set_to_infinity_by_hand_read_as_the_ends_of_the_range_never_a_panic() {
    let (_db, pool) = setup().await;
    let (earliest, latest) = readable_range();
    let by_hand = async |id: i64, set: &str| {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE pgonce.jobs SET {set} WHERE id = $1"
        )))
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    };

    // Parked: busy until the end of what reads back, never claimed.
    let parked = new_job(&pool, 1).await;
    by_hand(parked, "run_at = 'infinity'").await;
    assert_eq!(busy(&pool, parked).await, (JobStatus::Pending, latest));
    let row = job::get(&pool, parked).await.unwrap().unwrap();
    assert_eq!((row.run_at, row.lease_expires_at), (latest, None));

    // First in line: claimed, and dies on its last attempt like any job.
    let first = new_job(&pool, 1).await;
    by_hand(first, "run_at = '-infinity'").await;
    assert_eq!(
        job::get(&pool, first).await.unwrap().unwrap().run_at,
        earliest
    );
    let lease = job::claim(&pool, first, LEASE).await.unwrap();
    let out = job::fail(&pool, &lease, "boom", &RetryPolicy::default()).await;
    assert_eq!(out.unwrap(), FailOutcome::Dead { attempts: 1 });

    // A lease pinned by hand: a duplicate delivery is told to come back.
    let pinned = new_job(&pool, 1).await;
    let lease = job::claim(&pool, pinned, LEASE).await.unwrap();
    by_hand(pinned, "lease_expires_at = 'infinity'").await;
    assert_eq!(busy(&pool, pinned).await, (JobStatus::Processing, latest));
    let row = job::get(&pool, pinned).await.unwrap().unwrap();
    assert_eq!(row.lease_expires_at, Some(latest));
    job::complete(&pool, &lease, &json!("done")).await.unwrap();
}

/// A lease naming a transaction the server has not reached: its claim was
/// committed with `synchronous_commit = off` and lost in a crash (recovery
/// may hand that transaction id out again, later), or the lease was
/// rebuilt with a wrong id, one no server ever hands out included. No such
/// transaction took the lease, and none can still commit it, so the lease
/// is lost. The fence asked for a retry (40001) instead, and every retry
/// asked again, until the server's counter passed that id: on a quiet
/// server, for good; for an id no server hands out, forever.
#[tokio::test]
async fn a_lease_from_a_transaction_the_server_has_not_reached_is_lost_not_retried() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let future = support::next_xid(&pool).await + 1_000_000;
    // The job's insert committed in this (32-bit) transaction id: one
    // epoch later, the 64-bit id names a transaction not reached yet, not
    // that one.
    let inserted_in: i64 =
        sqlx::query_scalar("SELECT xmin::text::bigint FROM pgonce.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    // 3, the first normal id: older than any transaction the server keeps
    // a status for (pg_xact_status says NULL), visible in every snapshot.
    // Ids whose low 32 bits are 0, 1 or 2 (PostgreSQL's special ids, which
    // no epoch hands out) past the snapshot: pg_xact_status answers for
    // the special id (NULL or committed) instead of saying it is in the
    // future. i64::MIN and i64::MIN + 1 are such ids, 2^63 and 2^63 + 1.
    let special = [
        1 << 32,
        (1 << 32) + 1,
        (1 << 32) + 2,
        i64::MIN,
        i64::MIN + 1,
    ];
    for claimed_in in [future, i64::MAX, -1, (1 << 32) + inserted_in, 3]
        .into_iter()
        .chain(special)
    {
        let lease = job::Lease {
            job_id: id,
            token: uuid::Uuid::new_v4(),
            expires_at: time::OffsetDateTime::now_utc(),
            claimed_in,
        };
        let lost = |what: &str, out: pgonce::Result<()>| {
            assert!(
                matches!(out, Err(Error::LeaseLost { .. })),
                "{what} under a lease taken in {claimed_in}: {out:?}"
            );
        };
        lost("complete", job::complete(&pool, &lease, &json!("x")).await);
        lost(
            "fail",
            job::fail(&pool, &lease, "x", &RetryPolicy::default())
                .await
                .map(drop),
        );
        lost(
            "heartbeat",
            job::heartbeat(&pool, &lease, LEASE).await.map(drop),
        );
        let many = job::complete_many(&pool, &[(lease.clone(), json!("x"))]).await;
        assert_eq!(many.unwrap(), [id], "complete_many, {claimed_in}");
        // In a REPEATABLE READ transaction too, whose snapshot sees no
        // transaction newer than itself.
        let mut tx = pgonce::begin(&pool, IsolationLevel::RepeatableRead)
            .await
            .unwrap();
        lost(
            "complete at REPEATABLE READ",
            job::complete(&mut *tx, &lease, &json!("x")).await,
        );
        tx.rollback().await.unwrap();
    }
    // The job is as the lost claim left it: pending, and claimable.
    assert_eq!(status(&pool, id).await, JobStatus::Pending);
    job::claim(&pool, id, LEASE).await.unwrap();
}

/// A statement run on a pool is a transaction of its own at the database's
/// default isolation level: READ COMMITTED unless an operator set another
/// (`ALTER DATABASE ... SET default_transaction_isolation`). Under
/// REPEATABLE READ a claim that loses a race on the pool is then a
/// serialization failure, not `JobBusy`; its message is kept all the same
/// under either policy, and the retry, with a fresh snapshot, is busy.
#[tokio::test]
async fn a_pool_at_a_stricter_default_isolation_loses_a_claim_race_with_a_retry() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{}\" SET default_transaction_isolation = 'repeatable read'",
        db.name()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let race = Interleaving::new(db.options()).await.unwrap();
    let (a, _, lost) = claim_race(&race, id).await;
    let level: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(a.pool())
        .await
        .unwrap();
    assert_eq!(level, "repeatable read");
    assert!(lost.as_ref().is_err_and(Error::is_retryable), "{lost:?}");
    for policy in [
        pgonce::AckPolicy::DeleteOnSuccess,
        pgonce::AckPolicy::AlwaysDelete,
    ] {
        assert!(!policy.delete_message(&lost), "{policy:?}");
    }
    let again = job::claim(a.pool(), id, LEASE).await;
    assert!(
        matches!(
            again,
            Err(Error::JobBusy {
                status: JobStatus::Processing,
                ..
            })
        ),
        "{again:?}"
    );
}

/// A job that failed once and is due for its retry now.
async fn failed_and_due(pool: &PgPool) -> i64 {
    let id = new_job(pool, 5).await;
    let lease = job::claim(pool, id, LEASE).await.unwrap();
    job::fail(pool, &lease, "x", &RetryPolicy::default())
        .await
        .unwrap();
    sqlx::query("UPDATE pgonce.jobs SET run_at = now() - interval '1 second' WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    id
}

/// The re-driver's ids are what a queue worker re-publishes: a job made
/// pending without its id handed back has no message to drive it. A pass
/// commits batch by batch; one whose later batch failed (its connection
/// lost to a restart, a statement refused) returned only the error, and
/// the ids of the batches it had committed were gone with it. It returns
/// them now, and the next pass takes the rest.
#[tokio::test]
async fn a_redrive_pass_failing_part_way_hands_back_what_it_committed() {
    let (_db, pool) = setup().await;
    let first = failed_and_due(&pool).await;
    let second = failed_and_due(&pool).await;
    // The second batch's statement fails, as a lost connection would.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'refused on purpose'; END $$; \
         CREATE TRIGGER refuse BEFORE UPDATE ON pgonce.jobs FOR EACH ROW \
         WHEN (NEW.id = {second} AND NEW.status = 'pending') EXECUTE FUNCTION public.refuse();"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let redriver = Redriver::new(
        pool.clone(),
        RedriverConfig {
            batch_size: 1,
            ..RedriverConfig::default()
        },
    )
    .unwrap();
    let pass = redriver.run_once().await;
    assert!(matches!(&pass, Ok(c) if c.ids == [first]), "{pass:?}");
    assert_eq!(status(&pool, first).await, JobStatus::Pending);
    assert_eq!(status(&pool, second).await, JobStatus::Failed);
    sqlx::query("DROP TRIGGER refuse ON pgonce.jobs")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(redriver.run_once().await.unwrap().ids, [second]);
}

/// A call of a re-driver's hand-on, held by the test: the ids it was
/// given, and where the test says how it ends.
struct HandOn {
    ids: Vec<i64>,
    reply: tokio::sync::oneshot::Sender<Result<(), String>>,
}

/// The reply that makes a hand-on of `run_handing_on_to_the_test` panic.
const PANIC: &str = "panic";

/// Runs `redriver`'s loop (`run_handing_on`) in a task until the returned
/// sender fires, each hand-on sent to the returned receiver and ended as
/// the test replies (with [`PANIC`]: it panics).
fn run_handing_on_to_the_test(
    redriver: Redriver,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::mpsc::UnboundedReceiver<HandOn>,
    tokio::task::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (calls, handed) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(redriver.run_handing_on(
        async move {
            let _ = stopped.await;
        },
        move |ids| {
            let calls = calls.clone();
            async move {
                let (reply, replied) = tokio::sync::oneshot::channel();
                calls.send(HandOn { ids, reply }).unwrap();
                match replied.await {
                    Ok(Err(why)) if why == PANIC => panic!("the hand-on panicked"),
                    Ok(out) => out,
                    Err(_) => Err("the test let go".into()),
                }
            }
        },
    ));
    (stop, handed, task)
}

/// The next hand-on of the loop.
async fn next_hand_on(handed: &mut tokio::sync::mpsc::UnboundedReceiver<HandOn>) -> HandOn {
    let mut call = tokio::time::timeout(Duration::from_secs(20), handed.recv())
        .await
        .expect("the loop hands ids on")
        .expect("the loop is running");
    call.ids.sort();
    call
}

/// A re-driver whose loop passes every 10 ms.
fn quick_redriver(pool: &PgPool) -> Redriver {
    Redriver::new(
        pool.clone(),
        RedriverConfig {
            interval: Duration::from_millis(10),
            ..RedriverConfig::default()
        },
    )
    .unwrap()
}

/// A hand-on that keeps failing (the queue it publishes to is down) is a
/// failed pass of the re-driver's loop, logged as the loop's other
/// failures: the first at warn with its error, the others at debug (a
/// warn line a minute at most, none here unless the machine held the
/// test up for a minute), one info line once a hand-on succeeds again,
/// and each counted in `pgonce_service_failed_passes_total`. Driven hand-on
/// by hand-on: the test answers each. (Each refused hand-on was logged at
/// warn, a line per pass for as long as the queue was down, and counted
/// nowhere.)
#[tokio::test]
async fn a_hand_on_that_keeps_failing_is_logged_a_line_a_minute_and_counted() {
    let (_db, pool) = setup().await;
    let job = failed_and_due(&pool).await;
    let (metric, recorder) = support::count_of("pgonce_service_failed_passes_total");
    // On this single-threaded runtime the loop's task records here too.
    let _local = metrics::set_default_local_recorder(&recorder);
    let logged = pgonce_testkit::logs::LogLines::default();
    let _logging = logged.capture();
    let failing_from = std::time::Instant::now();
    let (stop, mut handed, task) = run_handing_on_to_the_test(quick_redriver(&pool));
    const REFUSED: u64 = 5;
    for _ in 0..REFUSED {
        let call = next_hand_on(&mut handed).await;
        assert_eq!(call.ids, [job]);
        call.reply.send(Err("queue down".into())).unwrap();
    }
    let call = next_hand_on(&mut handed).await;
    call.reply.send(Ok(())).unwrap();
    stop_loop(stop, task).await;
    let failing_for = failing_from.elapsed();

    assert_eq!(status(&pool, job).await, JobStatus::Pending);
    assert_eq!(
        metric.load(Ordering::SeqCst),
        REFUSED,
        "each refusal counted"
    );
    let first = logged.assert_run_of_failures(
        REFUSED,
        failing_for,
        "redriver pass failed",
        "redriver passes still failing",
        Some(&format!(
            "redriver pass succeeded after {REFUSED} failed passes since "
        )),
    );
    assert!(
        first
            .error
            .as_deref()
            .is_some_and(|e| e.ends_with("queue down")),
        "with its error: {first:?}"
    );
}

/// A pass whose hand-on failed has rolled its batch back by the time the
/// next pass runs, which hands the same jobs on again. Driven with a pool
/// that holds every connection given back to it (in `after_release`, the
/// step before sqlx tests the connection and so sends a ROLLBACK it only
/// queued) until the test lets them go. (The failed batch's transaction was
/// left to its drop: it held the jobs' rows until the pool tested its
/// connection, and the next passes, on other connections, skipped them and
/// succeeded with nothing, ending the run of failures in the log in the
/// middle of it. Seen on a loaded machine as a second "pass failed" line at
/// warn.)
#[tokio::test]
async fn a_pass_after_a_failed_hand_on_finds_its_jobs_unlocked() {
    let (db, pool) = setup().await;
    let job = failed_and_due(&pool).await;
    let (let_go, held) = tokio::sync::watch::channel(false);
    let holding = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .after_release(move |_, _| {
            let mut held = held.clone();
            Box::pin(async move {
                let _ = held.wait_for(|go| *go).await;
                Ok(true)
            })
        })
        .connect_with(db.options())
        .await
        .unwrap();
    let (stop, mut handed, task) = run_handing_on_to_the_test(quick_redriver(&holding));

    let call = next_hand_on(&mut handed).await;
    assert_eq!(call.ids, [job]);
    call.reply.send(Err("queue down".into())).unwrap();
    let call = next_hand_on(&mut handed).await;
    assert_eq!(call.ids, [job], "the next pass hands the same job on");
    call.reply.send(Ok(())).unwrap();

    let_go.send_replace(true);
    stop_loop(stop, task).await;
    assert_eq!(status(&pool, job).await, JobStatus::Pending);
}

/// A hand-on that never returns (a publish waiting on a peer that does
/// not answer) stopped the re-driver's loop for good, the batch's rows
/// locked and its jobs failed with no message. It is given up at
/// `hand_on_timeout` (its future dropped: the reply the test holds for it
/// is closed) and the batch rolled back, so the next pass hands the same
/// ids on; once that hand-on succeeds, the jobs are pending.
#[tokio::test]
async fn a_hand_on_that_never_returns_is_given_up_and_its_ids_handed_on_again() {
    let (_db, pool) = setup().await;
    let jobs = [failed_and_due(&pool).await, failed_and_due(&pool).await];
    let redriver = Redriver::new(
        pool.clone(),
        RedriverConfig {
            interval: Duration::from_millis(10),
            hand_on_timeout: Duration::from_millis(200),
            ..RedriverConfig::default()
        },
    )
    .unwrap();
    let (stop, mut handed, task) = run_handing_on_to_the_test(redriver);
    let hung = hand_on_of_failed_jobs(&mut handed, &pool, &jobs, "the first pass").await;
    // Never answered: the next call comes only once this one is given up.
    let call = hand_on_of_failed_jobs(&mut handed, &pool, &jobs, "after the hang").await;
    assert!(hung.reply.is_closed(), "the hung hand-on was dropped");
    call.reply.send(Ok(())).unwrap();
    stop_loop(stop, task).await;
    for id in jobs {
        assert_eq!(status(&pool, id).await, JobStatus::Pending);
    }
}

/// `Redriver::run` dropped the ids each pass made pending, and a caller of
/// `run_once` who failed to publish them (or died first) left those jobs
/// pending with no message. `run_handing_on` hands each batch's ids on
/// inside the batch's transaction and commits only once the hand-on
/// succeeded. Step by step: while the hand-on runs the jobs are still
/// failed; a hand-on that fails rolls the batch back, and the next pass
/// hands the same ids on; a commit that fails after the hand-on leaves
/// them failed (and due: their messages claim them) and the next pass
/// hands them on again; once a batch commits, they are pending and handed
/// on no more.
#[tokio::test]
async fn the_redriver_loop_hands_ids_on_before_their_batch_commits() {
    let (_db, pool) = setup().await;
    let first = failed_and_due(&pool).await;
    let second = failed_and_due(&pool).await;
    // A commit refused while the flag is up: a constraint trigger deferred
    // to the commit, reading a table the test changes without waiting on
    // the pass's locks.
    sqlx::raw_sql(
        "CREATE TABLE public.refuse_commit (up boolean NOT NULL); \
         INSERT INTO public.refuse_commit VALUES (true); \
         CREATE FUNCTION public.refuse_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
             IF (SELECT up FROM public.refuse_commit) THEN \
                 RAISE EXCEPTION 'commit refused on purpose'; \
             END IF; \
             RETURN NULL; \
         END $$; \
         CREATE CONSTRAINT TRIGGER refuse_commit AFTER UPDATE ON pgonce.jobs \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.refuse_commit();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (stop, mut handed, task) = run_handing_on_to_the_test(quick_redriver(&pool));
    let jobs = [first, second];

    let call = hand_on_of_failed_jobs(&mut handed, &pool, &jobs, "the first pass").await;
    call.reply.send(Err("the queue is down".into())).unwrap();
    let call = hand_on_of_failed_jobs(&mut handed, &pool, &jobs, "after a failed hand-on").await;
    call.reply.send(Ok(())).unwrap();
    let call = hand_on_of_failed_jobs(&mut handed, &pool, &jobs, "after a failed commit").await;
    sqlx::query("UPDATE public.refuse_commit SET up = false")
        .execute(&pool)
        .await
        .unwrap();
    call.reply.send(Ok(())).unwrap();

    stop_loop(stop, task).await;
    for id in jobs {
        assert_eq!(status(&pool, id).await, JobStatus::Pending);
    }
    assert!(
        handed.try_recv().is_err(),
        "nothing handed on once committed"
    );
}

/// The loop's next hand-on, which must be of `jobs` while they are still
/// failed: their batch has not committed.
async fn hand_on_of_failed_jobs(
    handed: &mut tokio::sync::mpsc::UnboundedReceiver<HandOn>,
    pool: &PgPool,
    jobs: &[i64],
    when: &str,
) -> HandOn {
    let call = next_hand_on(handed).await;
    assert_eq!(call.ids, jobs, "{when}");
    for &id in jobs {
        assert_eq!(status(pool, id).await, JobStatus::Failed, "{when}");
    }
    call
}

/// Stops a loop `run_handing_on_to_the_test` started, and waits for it.
async fn stop_loop(stop: tokio::sync::oneshot::Sender<()>, task: tokio::task::JoinHandle<()>) {
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the loop stops")
        .unwrap();
}

/// A process that dies while its re-driver hands ids on (after the pass's
/// UPDATE, before its commit) loses no job: its transaction rolls back
/// with its connection, the jobs stay failed and due, and the next
/// re-driver hands them on.
#[tokio::test]
async fn a_redriver_dying_before_its_commit_leaves_the_ids_to_the_next() {
    let (db, pool) = setup().await;
    let id = failed_and_due(&pool).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let dying = race.session("dying").await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(dying.pool())
        .await
        .unwrap();
    let (_stop, mut handed, task) = run_handing_on_to_the_test(quick_redriver(dying.pool()));
    let call = hand_on_of_failed_jobs(&mut handed, &pool, &[id], "the dying re-driver").await;
    // The process dies: its connection goes (the server waits for the
    // backend to end), its task with it.
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 20000)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ended);
    task.abort();
    drop(call);
    assert_eq!(status(&pool, id).await, JobStatus::Failed);

    let (stop, mut handed, task) = run_handing_on_to_the_test(quick_redriver(&pool));
    let call = hand_on_of_failed_jobs(&mut handed, &pool, &[id], "the next re-driver").await;
    call.reply.send(Ok(())).unwrap();
    stop_loop(stop, task).await;
    assert_eq!(status(&pool, id).await, JobStatus::Pending);
}

/// The reaper's statement ran alone on its pool: a transaction at the
/// database's default isolation level. Under REPEATABLE READ, a lease a
/// heartbeat extended after the statement's snapshot was a serialization
/// failure (40001) and the pass failed. At READ COMMITTED, as the reaper
/// runs now whatever the default, it re-reads the row and leaves the job.
#[tokio::test]
async fn the_reaper_under_a_stricter_default_isolation_leaves_a_lease_extended_meanwhile() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    job::claim(&pool, id, LEASE).await.unwrap();
    let (race, passer, writer) = support::pass_and_writer(db.options(), "reaper", "worker").await;
    let reaper = reaper(passer.pool());
    assert_eq!(reaper.run_once().await.unwrap(), ReapCounts::default());
    expire_lease(&pool, id).await;
    let out = support::pass_meeting_a_committed_change(
        &race,
        &passer,
        &writer,
        "pgonce.jobs",
        &format!(
            "UPDATE pgonce.jobs SET lease_expires_at = now() + interval '1 hour' WHERE id = {id}"
        ),
        async move { reaper.run_once().await },
    )
    .await;
    assert_eq!(out.unwrap(), ReapCounts::default());
    assert_eq!(status(&pool, id).await, JobStatus::Processing);
}

/// As for the reaper: the re-driver's statement ran at the database's
/// default level, and under REPEATABLE READ a due failed job an operator
/// postponed after the statement's snapshot was a serialization failure.
/// At READ COMMITTED the re-driver re-reads it and leaves it failed.
#[tokio::test]
async fn the_redriver_under_a_stricter_default_isolation_leaves_a_job_postponed_meanwhile() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    job::fail(&pool, &lease, "boom", &RetryPolicy::default())
        .await
        .unwrap();
    let (race, passer, writer) =
        support::pass_and_writer(db.options(), "redriver", "operator").await;
    let redriver = Redriver::new(passer.pool().clone(), RedriverConfig::default()).unwrap();
    assert_eq!(redriver.run_once().await.unwrap().redriven, 0);
    sqlx::query("UPDATE pgonce.jobs SET run_at = now() - interval '1 second' WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    let out = support::pass_meeting_a_committed_change(
        &race,
        &passer,
        &writer,
        "pgonce.jobs",
        &format!("UPDATE pgonce.jobs SET run_at = now() + interval '1 hour' WHERE id = {id}"),
        async move { redriver.run_once().await },
    )
    .await;
    assert_eq!(out.unwrap().redriven, 0);
    assert_eq!(status(&pool, id).await, JobStatus::Failed);
}

/// `retry_dead` on a bare connection ran each statement at the database's
/// default level: under SERIALIZABLE, waiting for another operator's retry
/// of the same job and meeting it once committed was a serialization
/// failure. It runs in a READ COMMITTED transaction of its own now and
/// says the job is no longer dead.
#[tokio::test]
async fn retry_dead_on_a_bare_connection_under_a_stricter_default_isolation_says_not_dead() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 1).await;
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    job::fail(&pool, &lease, "boom", &RetryPolicy::default())
        .await
        .unwrap();
    assert_eq!(status(&pool, id).await, JobStatus::Dead);
    let race = Interleaving::new(db.options()).await.unwrap();
    let first = race.session("first").await.unwrap();
    let second = race.session("second").await.unwrap();
    second
        .set("default_transaction_isolation", "serializable")
        .await
        .unwrap();
    let by = job::RetryBy {
        who: "ops",
        reason: None,
    };
    let mut tx = pgonce::begin(first.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(&first, "retry", job::retry_dead(&mut tx, id, by))
        .await
        .unwrap()
        .unwrap();
    let second_pool = second.pool().clone();
    let waiting = race
        .step_blocks(&second, "retry", async move {
            let mut conn = second_pool.acquire().await.unwrap();
            let by = job::RetryBy {
                who: "ops",
                reason: None,
            };
            job::retry_dead(&mut conn, id, by).await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["first"]);
    race.step(&first, "COMMIT", tx.commit())
        .await
        .unwrap()
        .unwrap();
    let out = waiting.resume().await.unwrap();
    assert!(
        matches!(
            out,
            Err(Error::JobNotDead {
                status: Some(JobStatus::Pending),
                ..
            })
        ),
        "{out:?}"
    );
    let retries: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.job_retries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(retries, 1);
}

/// `claim_batch` on a pool ran its statement alone, at the database's
/// default level: under REPEATABLE READ, a runnable job another poller
/// claimed after the statement's snapshot was a serialization failure, and
/// the poller got an error instead of passing the job over. It runs at
/// READ COMMITTED now whatever the default, and re-reads the job.
#[tokio::test]
async fn claim_batch_on_a_pool_under_a_stricter_default_isolation_passes_over_a_job_claimed_meanwhile()
 {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let (race, passer, writer) =
        support::pass_and_writer(db.options(), "poller", "other poller").await;
    assert!(
        job::claim_batch(passer.pool(), "other", 10, LEASE)
            .await
            .unwrap()
            .is_empty()
    );
    let poller = passer.pool().clone();
    let out = support::pass_meeting_a_committed_change(
        &race,
        &passer,
        &writer,
        "pgonce.jobs",
        &format!(
            "UPDATE pgonce.jobs SET status = 'processing', lease_token = gen_random_uuid(), \
             lease_expires_at = now() + interval '1 minute', claimed_at = now() WHERE id = {id}"
        ),
        async move { job::claim_batch(&poller, "send", 10, LEASE).await },
    )
    .await;
    assert!(out.unwrap().is_empty());
    assert_eq!(status(&pool, id).await, JobStatus::Processing);
}

/// `job::retries` read `retried_at` and `dead_since` as they were stored,
/// and sqlx's decoding panics on PostgreSQL's `infinity`: a dead job whose
/// `finished_at` an operator had set to `infinity` by hand carried it into
/// its audit row when retried, and reading the audit panicked. Such a time
/// reads as the nearest end of the range, as `get` reads the job's.
#[tokio::test]
async fn retries_set_to_infinity_by_hand_read_as_the_ends_of_the_range_never_a_panic() {
    let (_db, pool) = setup().await;
    let (earliest, latest) = readable_range();
    let id = new_job(&pool, 1).await;
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    job::fail(&pool, &lease, "boom", &RetryPolicy::default())
        .await
        .unwrap();
    sqlx::query("UPDATE pgonce.jobs SET finished_at = 'infinity' WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    let by = job::RetryBy {
        who: "ops",
        reason: None,
    };
    let mut conn = pool.acquire().await.unwrap();
    job::retry_dead(&mut conn, id, by).await.unwrap();
    let audit = job::retries(&mut conn, id).await.unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].dead_since, latest);
    sqlx::query("UPDATE pgonce.job_retries SET retried_at = '-infinity', dead_since = '-infinity'")
        .execute(&pool)
        .await
        .unwrap();
    let audit = job::retries(&mut conn, id).await.unwrap();
    assert_eq!(
        (audit[0].retried_at, audit[0].dead_since),
        (earliest, earliest)
    );
}

/// A failed job whose retry has come due is claimed by its message, as a
/// due pending job is: the claim does not wait for the re-driver. Before,
/// it answered `JobBusy` with a `not_before` already past until the
/// re-driver's next pass, and each return of the kept message counted
/// towards the dead-letter queue. Before its `run_at` it is still busy.
#[tokio::test]
async fn a_failed_job_whose_retry_is_due_is_claimed_without_the_redriver() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    let outcome = job::fail(&pool, &lease, "boom", &RetryPolicy::default())
        .await
        .unwrap();
    let FailOutcome::Retry { run_at, .. } = outcome else {
        panic!("expected a retry, got {outcome:?}");
    };
    let out = job::claim(&pool, id, LEASE).await;
    assert!(
        matches!(out, Err(Error::JobBusy { status: JobStatus::Failed, not_before, .. })
            if not_before == run_at),
        "{out:?}"
    );
    sqlx::query("UPDATE pgonce.jobs SET run_at = now() - interval '1 second' WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(
        (row.status().unwrap(), row.attempts),
        (JobStatus::Processing, 1)
    );
    let redriver = Redriver::new(pool.clone(), RedriverConfig::default()).unwrap();
    assert_eq!(redriver.run_once().await.unwrap().redriven, 0);
    job::complete(&pool, &lease, &json!("done")).await.unwrap();
    assert_eq!(status(&pool, id).await, JobStatus::Completed);
}

/// A claim of a due failed job (migration 0240) and the Redriver's pass
/// over it, in either order: the claim holding the row, the pass skips it
/// and the job ends processing under the claim's lease; the pass holding
/// the row (kept inside its transaction by a trigger that waits for an
/// advisory lock), the claim waits for it, then takes the job the pass
/// made pending. Each way the job runs once, under one lease, its attempt
/// counted once.
#[tokio::test]
async fn a_claim_and_the_redriver_racing_for_a_due_failed_job_agree_in_either_order() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();

    // The claim first: the pass skips the row it holds.
    let id = failed_and_due(&pool).await;
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    let lease = race
        .step(&a, "claim", job::claim(&mut *tx_a, id, LEASE))
        .await
        .unwrap()
        .unwrap();
    let redriver = Redriver::new(pool.clone(), RedriverConfig::default()).unwrap();
    assert_eq!(redriver.run_once().await.unwrap().ids, Vec::<i64>::new());
    race.step(&a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(redriver.run_once().await.unwrap().ids, Vec::<i64>::new());
    job::complete(&pool, &lease, &json!("done")).await.unwrap();
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(
        (row.status().unwrap(), row.attempts),
        (JobStatus::Completed, 1)
    );

    // The pass first: held inside its transaction after its UPDATE, the
    // claim waits for its row lock, then claims the pending job.
    let id = failed_and_due(&pool).await;
    sqlx::raw_sql(
        "CREATE FUNCTION public.hold_redrive() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
             IF OLD.status = 'failed' AND NEW.status = 'pending' THEN \
                 PERFORM pg_advisory_xact_lock_shared(4240); \
             END IF; \
             RETURN NEW; \
         END $$; \
         CREATE TRIGGER hold_redrive AFTER UPDATE ON pgonce.jobs \
             FOR EACH ROW EXECUTE FUNCTION public.hold_redrive();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let h = race.session("H").await.unwrap();
    let r = race.session("R").await.unwrap();
    let c = race.session("C").await.unwrap();
    let mut tx_h = pgonce::begin(h.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(
        &h,
        "advisory lock",
        sqlx::query("SELECT pg_advisory_xact_lock(4240)").execute(&mut *tx_h),
    )
    .await
    .unwrap()
    .unwrap();
    let redriver_r = Redriver::new(r.pool().clone(), RedriverConfig::default()).unwrap();
    let pass = race
        .step_blocks(&r, "redrive", async move { redriver_r.run_once().await })
        .await
        .unwrap();
    assert_eq!(pass.blocked_by(), ["H"]);
    let pool_c = c.pool().clone();
    let claim = race
        .step_blocks(
            &c,
            "claim",
            async move { job::claim(&pool_c, id, LEASE).await },
        )
        .await
        .unwrap();
    assert_eq!(claim.blocked_by(), ["R"]);
    race.step(&h, "COMMIT", tx_h.commit())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(pass.resume().await.unwrap().unwrap().ids, [id]);
    let lease = claim.resume().await.unwrap().unwrap();
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(
        (row.status().unwrap(), row.attempts),
        (JobStatus::Processing, 1)
    );
    assert_eq!(redriver.run_once().await.unwrap().ids, Vec::<i64>::new());
    job::complete(&pool, &lease, &json!("done")).await.unwrap();
    assert_eq!(status(&pool, id).await, JobStatus::Completed);
}

/// A Reaper pass given up (its future dropped) while its statement waits,
/// inside the READ COMMITTED transaction the pass opened on a connection
/// of its pool: the statement's work is rolled back, and the connection
/// goes back to the pool outside any transaction, so what runs on it next
/// commits.
#[tokio::test]
async fn a_reaper_pass_dropped_mid_transaction_leaves_its_connection_clean() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    job::claim(&pool, id, LEASE).await.unwrap();
    expire_lease(&pool, id).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let w = race.session("W").await.unwrap();
    let p = race.session("P").await.unwrap();
    let mut tx_w = pgonce::begin(w.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    race.step(
        &w,
        "lock jobs",
        sqlx::query("LOCK TABLE pgonce.jobs IN SHARE ROW EXCLUSIVE MODE").execute(&mut *tx_w),
    )
    .await
    .unwrap()
    .unwrap();
    let reaper_p = reaper(p.pool());
    let pass = race
        .step_blocks(&p, "reap", async move { reaper_p.run_once().await })
        .await
        .unwrap();
    assert_eq!(pass.blocked_by(), ["W"]);
    pass.cancel();
    race.step(&w, "COMMIT", tx_w.commit())
        .await
        .unwrap()
        .unwrap();
    // The session's one connection, once the pool has it back: idle, not
    // idle in a transaction, as another backend sees it.
    let mut conn = p.pool().acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let state: String = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(state, "idle");
    drop(conn);
    assert_eq!(status(&pool, id).await, JobStatus::Processing);
    sqlx::query("UPDATE pgonce.jobs SET last_error = 'written after' WHERE id = $1")
        .bind(id)
        .execute(p.pool())
        .await
        .unwrap();
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(row.last_error.as_deref(), Some("written after"));
    assert_eq!(reaper(&pool).run_once().await.unwrap().returned, 1);
}

/// A caller's transaction begun by hand (`BEGIN` run as a statement, so
/// sqlx does not know of it) on the connection given to claim_batch or
/// retry_dead: the call runs inside it, at its level, and the caller's
/// ROLLBACK undoes the caller's own write and the call's together. A BEGIN
/// and COMMIT of the call's own would have committed the caller's
/// transaction half way (READ COMMITTED), or been refused (REPEATABLE
/// READ, whose snapshot was taken).
#[tokio::test]
async fn a_transaction_begun_by_hand_holds_claim_batch_and_retry_dead() {
    let (_db, pool) = setup().await;
    let pending = new_job(&pool, 5).await;
    let dead = new_job(&pool, 1).await;
    let lease = job::claim(&pool, dead, LEASE).await.unwrap();
    job::fail(&pool, &lease, "boom", &RetryPolicy::default())
        .await
        .unwrap();
    for begin in ["BEGIN", "BEGIN ISOLATION LEVEL REPEATABLE READ"] {
        let mut conn = pool.acquire().await.unwrap();
        let first =
            format!("{begin}; INSERT INTO pgonce.jobs (kind, payload) VALUES ('by hand', '{{}}')");
        sqlx::raw_sql(sqlx::AssertSqlSafe(first))
            .execute(&mut *conn)
            .await
            .unwrap();
        let claimed = job::claim_batch(&mut conn, "send", 5, LEASE).await;
        let ids: Vec<i64> = claimed.unwrap().iter().map(|c| c.lease.job_id).collect();
        assert_eq!(ids, [pending], "{begin}");
        job::retry_dead(&mut conn, dead, ALICE).await.unwrap();
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
        let by_hand: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pgonce.jobs WHERE kind = 'by hand'")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(
            (
                by_hand,
                status(&pool, pending).await,
                status(&pool, dead).await
            ),
            (0, JobStatus::Pending, JobStatus::Dead),
            "{begin}"
        );
    }
}

/// A claim made in a subtransaction (a savepoint) records the top-level
/// transaction's id, which `pg_current_xact_id()` returns there: rolled
/// back to the savepoint, the lease is lost to the same transaction's
/// complete (no 40001: the fence knows its own transaction); released,
/// the same transaction completes under it, and another connection is
/// told to retry (40001) while that transaction is open.
#[tokio::test]
async fn a_claim_in_a_savepoint_is_fenced_by_its_top_level_transaction() {
    let (_db, pool) = setup().await;
    let id = new_job(&pool, 5).await;

    let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    let mut savepoint = sqlx::Connection::begin(&mut *tx).await.unwrap();
    let lease = job::claim(&mut *savepoint, id, LEASE).await.unwrap();
    savepoint.rollback().await.unwrap();
    let out = job::complete(&mut *tx, &lease, &json!("x")).await;
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
    tx.rollback().await.unwrap();

    let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    let mut savepoint = sqlx::Connection::begin(&mut *tx).await.unwrap();
    let lease = job::claim(&mut *savepoint, id, LEASE).await.unwrap();
    savepoint.commit().await.unwrap();
    let elsewhere = job::complete(&pool, &lease, &json!("x")).await;
    assert!(
        matches!(elsewhere, Err(Error::SerializationFailure { .. })),
        "{elsewhere:?}"
    );
    job::complete(&mut *tx, &lease, &json!("done"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(status(&pool, id).await, JobStatus::Completed);
}

/// A job of `pool` whose holder's lease ran out, with the holder's lease.
async fn expired_job(pool: &PgPool, max_attempts: i32) -> (i64, job::Lease) {
    let id = new_job(pool, max_attempts).await;
    let holder = job::claim(pool, id, LEASE).await.unwrap();
    expire_lease(pool, id).await;
    (id, holder)
}

/// `session`'s claim of job `id`, whose lease ran out, in a transaction
/// left open: the transaction and the lease it took over.
async fn take_over_in_an_open_transaction(
    race: &Interleaving,
    session: &pgonce_testkit::Session,
    id: i64,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, job::Lease) {
    let mut taking = session.pool().begin().await.unwrap();
    let lease = race
        .step(session, "claim", job::claim(&mut *taking, id, LEASE))
        .await
        .unwrap()
        .expect("the lease ran out: taken over");
    (taking, lease)
}

/// `session`'s claim of job `id`, seen waiting for the session named
/// `blocker`.
async fn claim_blocked_by(
    race: &Interleaving,
    session: &pgonce_testkit::Session,
    id: i64,
    blocker: &str,
) -> pgonce_testkit::Blocked<pgonce::Result<job::Lease>> {
    let pool = session.pool().clone();
    let claim = race
        .step_blocks(session, "claim", async move {
            job::claim(&pool, id, LEASE).await
        })
        .await
        .unwrap();
    assert_eq!(claim.blocked_by(), [blocker]);
    claim
}

/// Ends `session`'s transaction `tx` as a step: COMMIT when `commits`,
/// else ROLLBACK.
async fn end_step(
    race: &Interleaving,
    session: &pgonce_testkit::Session,
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    commits: bool,
) {
    let ended = if commits {
        race.step(session, "COMMIT", tx.commit()).await
    } else {
        race.step(session, "ROLLBACK", tx.rollback()).await
    };
    ended.unwrap().unwrap();
}

/// The job's status, attempts and lease token.
async fn attempts_and_token(pool: &PgPool, id: i64) -> (JobStatus, i32, Option<uuid::Uuid>) {
    let row = job::get(pool, id).await.unwrap().unwrap();
    (row.status().unwrap(), row.attempts, row.lease_token)
}

/// Holds every transaction that moves a job out of processing before its
/// commit (a deferred trigger waits for advisory lock 4242) while a
/// session holds that lock.
async fn hold_passes_before_their_commit(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE FUNCTION public.hold_reaper() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER hold_reaper AFTER UPDATE ON pgonce.jobs \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
             WHEN (OLD.status = 'processing' AND NEW.status <> 'processing') \
             EXECUTE FUNCTION public.hold_reaper();",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// A step of session `gate`: `statement` on the advisory lock held
/// passes wait for.
async fn gate_runs(
    race: &Interleaving,
    gate: &pgonce_testkit::Session,
    what: &str,
    statement: &'static str,
) {
    race.step(gate, what, sqlx::query(statement).execute(gate.pool()))
        .await
        .unwrap()
        .unwrap();
}

/// A reaper pass of session `reaping`, held before its commit by `gate`'s
/// advisory lock (see [`hold_passes_before_their_commit`]) and seen
/// waiting for it.
async fn reaper_pass_held(
    race: &Interleaving,
    gate: &pgonce_testkit::Session,
    reaping: &pgonce_testkit::Session,
) -> pgonce_testkit::Blocked<pgonce::Result<ReapCounts>> {
    gate_runs(race, gate, "lock", "SELECT pg_advisory_lock(4242)").await;
    let reaper_pool = reaping.pool().clone();
    let pass = race
        .step_blocks(reaping, "reap", async move {
            reaper(&reaper_pool).run_once().await
        })
        .await
        .unwrap();
    assert_eq!(pass.blocked_by(), ["gate"]);
    pass
}

/// A claim taking over an expired lease and a reaper pass on the same job
/// take turns on its row lock, and the expired attempt is counted once
/// whichever goes first. Reaper first: its pass is held before its commit
/// (a deferred trigger waits for an advisory lock the test holds), the
/// claim is seen waiting for the reaper's session, the pass commits (the
/// job pending, one attempt counted) and the claim then takes the pending
/// job without counting another. Claim first: the takeover holds the row
/// in an open transaction, a reaper pass skips it; after the commit the
/// lease is live, and a pass finds nothing.
#[tokio::test]
async fn a_takeover_and_the_reaper_count_an_expired_attempt_once_in_either_order() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let gate = race.session("gate").await.unwrap();
    let reaping = race.session("reaper").await.unwrap();
    let claimer = race.session("claimer").await.unwrap();
    hold_passes_before_their_commit(&pool).await;

    // The reaper first.
    let (id, holder) = expired_job(&pool, 3).await;
    let pass = reaper_pass_held(&race, &gate, &reaping).await;
    let claim = claim_blocked_by(&race, &claimer, id, "reaper").await;
    gate_runs(&race, &gate, "unlock", "SELECT pg_advisory_unlock(4242)").await;
    assert_eq!(pass.resume().await.unwrap().unwrap().returned, 1);
    let lease = claim
        .resume()
        .await
        .unwrap()
        .expect("the reaped job is claimed");
    assert_eq!(
        attempts_and_token(&pool, id).await,
        (JobStatus::Processing, 1, Some(lease.token)),
        "the expired attempt counted once"
    );
    let out = job::complete(&pool, &holder, &json!("late")).await;
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");

    // The claim first.
    let (id, holder) = expired_job(&pool, 3).await;
    let (taking, lease) = take_over_in_an_open_transaction(&race, &claimer, id).await;
    let reaped = race
        .step(&reaping, "reap", reaper(reaping.pool()).run_once())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        reaped,
        ReapCounts::default(),
        "the pass skips the claimed row"
    );
    race.step(&claimer, "COMMIT", taking.commit())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        reaper(&pool).run_once().await.unwrap(),
        ReapCounts::default()
    );
    assert_eq!(
        attempts_and_token(&pool, id).await,
        (JobStatus::Processing, 1, Some(lease.token)),
        "the expired attempt counted once"
    );
    let out = job::heartbeat(&pool, &holder, LEASE).await;
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
}

/// A holder's heartbeat and a claim of its job, once the lease ran out,
/// take turns on the row. The heartbeat first, in an open transaction:
/// the claim is seen waiting for it; committed, the lease is live again
/// and the claim is `JobBusy` until its new end, nothing counted; rolled
/// back, the claim takes the job over (one attempt counted) and the
/// holder's next heartbeat hears its lease lost. The takeover first, in an
/// open transaction: the heartbeat waits for it and, once it commits,
/// hears the lease lost, extending nothing; a takeover rolled back leaves
/// the holder's lease, which its heartbeat extends.
#[tokio::test]
async fn a_heartbeat_and_a_takeover_of_its_expired_lease_take_turns() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let holding = race.session("holder").await.unwrap();
    let claimer = race.session("claimer").await.unwrap();
    for commits in [true, false] {
        // The heartbeat first.
        let (id, holder) = expired_job(&pool, 3).await;
        let mut beating = holding.pool().begin().await.unwrap();
        let renewed = race
            .step(
                &holding,
                "heartbeat",
                job::heartbeat(&mut *beating, &holder, LEASE),
            )
            .await
            .unwrap()
            .expect("a lease nobody took over is still the holder's");
        let claim = claim_blocked_by(&race, &claimer, id, "holder").await;
        end_step(&race, &holding, beating, commits).await;
        if commits {
            let out = claim.resume().await.unwrap();
            assert!(
                matches!(
                    out,
                    Err(Error::JobBusy { status: JobStatus::Processing, not_before, .. })
                        if not_before == renewed.expires_at
                ),
                "{out:?}"
            );
            assert_eq!(
                attempts_and_token(&pool, id).await,
                (JobStatus::Processing, 0, Some(holder.token))
            );
        } else {
            let lease = claim.resume().await.unwrap().expect("taken over");
            assert_eq!(
                attempts_and_token(&pool, id).await,
                (JobStatus::Processing, 1, Some(lease.token))
            );
            let out = job::heartbeat(&pool, &holder, LEASE).await;
            assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
        }

        // The takeover first.
        let (id, holder) = expired_job(&pool, 3).await;
        let (taking, lease) = take_over_in_an_open_transaction(&race, &claimer, id).await;
        let holder_pool = holding.pool().clone();
        let held = holder.clone();
        let beat = race
            .step_blocks(&holding, "heartbeat", async move {
                job::heartbeat(&holder_pool, &held, LEASE).await
            })
            .await
            .unwrap();
        assert_eq!(beat.blocked_by(), ["claimer"]);
        end_step(&race, &claimer, taking, commits).await;
        if commits {
            let out = beat.resume().await.unwrap();
            assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
            assert_eq!(
                attempts_and_token(&pool, id).await,
                (JobStatus::Processing, 1, Some(lease.token))
            );
        } else {
            beat.resume()
                .await
                .unwrap()
                .expect("the holder's lease stands");
            assert_eq!(
                attempts_and_token(&pool, id).await,
                (JobStatus::Processing, 0, Some(holder.token))
            );
            let out = job::complete(&pool, &lease, &json!("undone")).await;
            assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
        }
    }
}

/// A claim in a REPEATABLE READ or SERIALIZABLE transaction whose snapshot
/// shows a lease that ran out, after another delivery took it over and
/// committed, cannot take it over a second time: a serialization failure,
/// and the retry, under a fresh snapshot, is `JobBusy` under the new
/// lease. One attempt is counted. A lease whose end is exactly the
/// claim's transaction time is not taken over (it has not run out).
#[tokio::test]
async fn a_claim_under_a_snapshot_older_than_a_takeover_asks_for_a_retry() {
    let (_db, pool) = setup().await;
    for level in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable] {
        let (id, _holder) = expired_job(&pool, 3).await;
        let mut older = pgonce::begin(&pool, level).await.unwrap();
        take_snapshot(&mut older).await;
        let lease = job::claim(&pool, id, LEASE).await.expect("taken over");
        asks_for_a_retry("claim", job::claim(&mut *older, id, LEASE).await);
        older.rollback().await.unwrap();
        let mut retry = pgonce::begin(&pool, level).await.unwrap();
        let out = job::claim(&mut *retry, id, LEASE).await;
        assert!(
            matches!(out, Err(Error::JobBusy { status: JobStatus::Processing, not_before, .. })
                if not_before == lease.expires_at),
            "{level:?}: {out:?}"
        );
        retry.rollback().await.unwrap();
        assert_eq!(
            attempts_and_token(&pool, id).await,
            (JobStatus::Processing, 1, Some(lease.token))
        );
    }
    // The edge: a lease ending at the claim's transaction time.
    let (id, holder) = expired_job(&pool, 3).await;
    let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    sqlx::query("UPDATE pgonce.jobs SET lease_expires_at = now() WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    let out = job::claim(&mut *tx, id, LEASE).await;
    assert!(
        matches!(
            out,
            Err(Error::JobBusy {
                status: JobStatus::Processing,
                ..
            })
        ),
        "{out:?}"
    );
    let reaped = job::get(&mut *tx, id).await.unwrap().unwrap();
    assert_eq!(reaped.lease_token, Some(holder.token));
    tx.rollback().await.unwrap();
}

/// A hand-on that panics (a bug in the publisher, a panicking client)
/// rolls its batch back as a failed hand-on does: the jobs stay failed
/// and due. The loop then goes on, as it does after a failed hand-on:
/// under `AckPolicy::AlwaysDelete` a failed job has no message, and the
/// re-driver's next pass is all that drives it. Step by step: the
/// panicking hand-on is answered while its jobs are still failed, the next
/// pass hands the same ids on, and once that one succeeds they are pending.
#[tokio::test]
async fn a_hand_on_that_panics_rolls_its_batch_back_and_the_loop_goes_on() {
    let (_db, pool) = setup().await;
    let id = failed_and_due(&pool).await;
    let (stop, mut handed, task) = run_handing_on_to_the_test(quick_redriver(&pool));
    let call = hand_on_of_failed_jobs(&mut handed, &pool, &[id], "the first pass").await;
    call.reply.send(Err(PANIC.into())).unwrap();
    let call = hand_on_of_failed_jobs(&mut handed, &pool, &[id], "after a panicking hand-on").await;
    call.reply.send(Ok(())).unwrap();
    stop_loop(stop, task).await;
    assert_eq!(status(&pool, id).await, JobStatus::Pending);
}

/// A takeover and `claim_batch`, which takes pending jobs only, never
/// share a job. The takeover open: the batch passes the processing job
/// over, before and after the commit. A job the reaper returned, claimed
/// by a batch in an open transaction: a claim of it waits for the batch,
/// then is `JobBusy` under the batch's live lease. And a job allowed one
/// attempt is never taken over: its lease's end is its last attempt's, the
/// claim makes it dead, and its message is then acknowledged.
#[tokio::test]
async fn a_takeover_and_claim_batch_never_share_a_job() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let batch = race.session("batch").await.unwrap();
    let claimer = race.session("claimer").await.unwrap();
    let claim_batch =
        async |tx: &mut sqlx::PgConnection| job::claim_batch(tx, "send", 10, LEASE).await.unwrap();

    let (id, _holder) = expired_job(&pool, 3).await;
    let (taking, lease) = take_over_in_an_open_transaction(&race, &claimer, id).await;
    assert!(
        claim_batch(&mut batch.pool().acquire().await.unwrap())
            .await
            .is_empty()
    );
    end_step(&race, &claimer, taking, true).await;
    assert!(
        claim_batch(&mut batch.pool().acquire().await.unwrap())
            .await
            .is_empty()
    );
    assert_eq!(
        attempts_and_token(&pool, id).await,
        (JobStatus::Processing, 1, Some(lease.token))
    );
    job::complete(&pool, &lease, &json!("done")).await.unwrap();

    let (id, _holder) = expired_job(&pool, 3).await;
    assert_eq!(reaper(&pool).run_once().await.unwrap().returned, 1);
    let mut batching = batch.pool().begin().await.unwrap();
    let claimed = race
        .step(&batch, "claim_batch", claim_batch(&mut batching))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let claim = claim_blocked_by(&race, &claimer, id, "batch").await;
    end_step(&race, &batch, batching, true).await;
    let out = claim.resume().await.unwrap();
    assert!(
        matches!(out, Err(Error::JobBusy { status: JobStatus::Processing, not_before, .. })
            if not_before == claimed[0].lease.expires_at),
        "{out:?}"
    );
    assert_eq!(
        attempts_and_token(&pool, id).await,
        (JobStatus::Processing, 1, Some(claimed[0].lease.token))
    );
    job::complete(&pool, &claimed[0].lease, &json!("done"))
        .await
        .unwrap();

    let (id, _holder) = expired_job(&pool, 1).await;
    let out = job::claim(&pool, id, LEASE).await;
    assert!(matches!(out, Err(Error::AlreadyHandled { .. })), "{out:?}");
    assert_eq!(
        attempts_and_token(&pool, id).await,
        (JobStatus::Dead, 1, None)
    );
}

/// The holder's own outcome and a claim taking its expired lease over
/// take turns on the job's row, and the holder's write never lands after
/// the takeover. The holder's `fail` or `complete` first, in an open
/// transaction: the claim is seen waiting for it; committed, the claim is
/// `JobBusy` (failed, its retry not due) or `AlreadyHandled` (completed),
/// one attempt counted for the failure and none for the completion;
/// rolled back, the claim takes the lease over, its attempt counted, and
/// the holder's next write hears the lease lost.
#[tokio::test]
async fn the_holders_outcome_and_a_takeover_of_its_expired_lease_take_turns() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let holding = race.session("holder").await.unwrap();
    let claimer = race.session("claimer").await.unwrap();
    for (fails, commits) in [(true, true), (true, false), (false, true), (false, false)] {
        let (id, holder) = expired_job(&pool, 3).await;
        let mut writing = holding.pool().begin().await.unwrap();
        if fails {
            let outcome = race
                .step(
                    &holding,
                    "fail",
                    job::fail(&mut *writing, &holder, "boom", &RetryPolicy::default()),
                )
                .await
                .unwrap()
                .expect("a lease nobody took over is still the holder's");
            assert!(matches!(outcome, FailOutcome::Retry { attempts: 1, .. }));
        } else {
            race.step(
                &holding,
                "complete",
                job::complete(&mut *writing, &holder, &json!("done")),
            )
            .await
            .unwrap()
            .expect("a lease nobody took over is still the holder's");
        }
        let claim = claim_blocked_by(&race, &claimer, id, "holder").await;
        end_step(&race, &holding, writing, commits).await;
        let out = claim.resume().await.unwrap();
        let what = format!("fails: {fails}, commits: {commits}: {out:?}");
        match (fails, commits) {
            (true, true) => {
                assert!(
                    matches!(
                        out,
                        Err(Error::JobBusy {
                            status: JobStatus::Failed,
                            ..
                        })
                    ),
                    "{what}"
                );
                assert_eq!(
                    attempts_and_token(&pool, id).await,
                    (JobStatus::Failed, 1, None)
                );
            }
            (false, true) => {
                assert!(matches!(out, Err(Error::AlreadyHandled { .. })), "{what}");
                assert_eq!(
                    attempts_and_token(&pool, id).await,
                    (JobStatus::Completed, 0, None)
                );
            }
            (_, false) => {
                let lease = out.expect("taken over once the holder's write rolled back");
                assert_eq!(
                    attempts_and_token(&pool, id).await,
                    (JobStatus::Processing, 1, Some(lease.token))
                );
                let late = job::complete(&pool, &holder, &json!("late")).await;
                assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
                let late = job::fail(&pool, &holder, "late", &RetryPolicy::default()).await;
                assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
                job::complete(&pool, &lease, &json!("done")).await.unwrap();
            }
        }
    }
}

/// A payload or results whose JSON text is longer than PostgreSQL takes
/// in one message (1 GiB) are refused as bad input, nothing written,
/// though jsonb would hold them: a control character is one byte in jsonb
/// and six (`\u0001`) in JSON text. The server dropped the connection
/// instead (`Connection reset by peer`). An enqueue, and a complete_many
/// whose results pass it together, one statement carrying them all.
#[tokio::test]
async fn json_longer_than_postgresql_takes_in_one_message_is_refused() {
    let (_db, pool) = setup().await;
    let controls = json!({ "text": "\u{1}".repeat(180 << 20) });
    let enqueued = job::enqueue(&pool, &NewJob::new("send", controls)).await;
    assert!(
        matches!(&enqueued, Err(Error::Invalid { what: "job payload", why }) if why.contains("1 GiB")),
        "enqueue: {:?}",
        enqueued.map_err(|e| format!("{e:?}"))
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 0, "a job was enqueued");

    let half = json!({ "text": "\u{1}".repeat(90 << 20) });
    let mut done = Vec::new();
    for _ in 0..2 {
        let id = job::enqueue(&pool, &NewJob::new("send", json!(null)))
            .await
            .unwrap();
        done.push((job::claim(&pool, id, LEASE).await.unwrap(), half.clone()));
    }
    let completed = job::complete_many(&pool, &done).await;
    assert!(
        matches!(&completed, Err(Error::Invalid { what: "job results", why }) if why.contains("1 GiB")),
        "complete_many: {:?}",
        completed.map_err(|e| format!("{e:?}"))
    );
    for (lease, _) in &done {
        let row = job::get(&pool, lease.job_id).await.unwrap().unwrap();
        assert_eq!(row.status().unwrap(), JobStatus::Processing);
    }

    // Under the message's limit but past jsonb's for one string
    // (268,435,455 bytes): PostgreSQL refuses it (54000) as it reads it in,
    // which is bad input too, nothing written.
    let past_jsonb = json!({ "text": "a".repeat(1 << 28) });
    let enqueued = job::enqueue(&pool, &NewJob::new("send", past_jsonb)).await;
    assert!(
        matches!(&enqueued, Err(Error::Invalid { what: "job payload", why }) if why.contains("jsonb")),
        "enqueue past jsonb's string limit: {:?}",
        enqueued.map_err(|e| format!("{e:?}"))
    );
    let count: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pgonce.jobs WHERE payload IS NOT NULL AND payload <> 'null'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(count, 0, "a job was enqueued");
}

/// A payload and a result read back as the `Value`s written, numbers
/// included. `jsonb` prints a number as it stored it, in plain digits: a
/// whole double that serde_json writes with an exponent (`1e16`, `2.5e18`)
/// was stored as an integer and came back as one, another `Value`. Checked
/// through `enqueue`, `complete`, `complete_many` and `transition`.
#[tokio::test]
async fn payloads_and_results_read_back_equal_numbers_included() {
    let (_db, pool) = setup().await;
    let value = json!({
        "whole doubles": [1e16, -1e16, 2.5e18, 1.8e19, 1e300, -0.0, 3.0],
        // The ends of the whole doubles whose plain digits read back as
        // integers (from i64::MIN to below 2^64), and the first past them.
        "at the integers' ends": [
            18446744073709549568.0, 18446744073709551616.0,
            -9223372036854775808.0, -9223372036854777856.0,
            -1.7976931348623157e308,
        ],
        "fractions": [0.1, 1e-7, 5e-324, 1.7976931348623157e308],
        "integers": [0, u64::MAX, i64::MIN, 12345678901234567_u64],
        "nested": {"z": 1e17, "a": [{"x": 4e16}]},
    });
    let payload_of = |id: i64| {
        let pool = pool.clone();
        async move { job::get(&pool, id).await.unwrap().unwrap() }
    };
    let first = job::enqueue(&pool, &NewJob::new("send", value.clone()))
        .await
        .unwrap();
    let second = job::enqueue(&pool, &NewJob::new("send", value.clone()))
        .await
        .unwrap();
    assert_eq!(payload_of(first).await.payload.unwrap(), value, "payload");

    let lease = job::claim(&pool, first, LEASE).await.unwrap();
    job::complete(&pool, &lease, &value).await.unwrap();
    assert_eq!(
        payload_of(first).await.result.unwrap().unwrap(),
        value,
        "complete's result"
    );
    let lease = job::claim(&pool, second, LEASE).await.unwrap();
    job::complete_many(&pool, &[(lease, value.clone())])
        .await
        .unwrap();
    assert_eq!(
        payload_of(second).await.result.unwrap().unwrap(),
        value,
        "complete_many's result"
    );
    let third = job::enqueue(&pool, &NewJob::new("send", json!(null)))
        .await
        .unwrap();
    job::transition(
        &pool,
        third,
        JobStatus::Pending,
        JobStatus::Completed,
        Some(&value),
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        payload_of(third).await.result.unwrap().unwrap(),
        value,
        "transition's result"
    );
}

/// Two deliveries of a job whose lease ran out on its last attempt, and
/// the holder's late outcome, take turns on the row. The first claim, in
/// an open transaction, makes the job dead; the second is seen waiting for
/// it. Committed, the second hears the job is dead (`AlreadyHandled`), the
/// expired attempt counted once, and the holder's outcome hears its lease
/// lost. Rolled back, the second claim makes the job dead itself.
#[tokio::test]
async fn claims_racing_for_an_expired_last_attempt_make_the_job_dead_once() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let first = race.session("first").await.unwrap();
    let second = race.session("second").await.unwrap();
    for commits in [true, false] {
        let (id, holder) = expired_job(&pool, 1).await;
        let mut claiming = first.pool().begin().await.unwrap();
        let out = race
            .step(&first, "claim", job::claim(&mut *claiming, id, LEASE))
            .await
            .unwrap();
        assert!(
            matches!(out, Err(Error::AlreadyHandled { .. })),
            "the last attempt's lease ran out: the job is dead, {out:?}"
        );
        let claim = claim_blocked_by(&race, &second, id, "first").await;
        end_step(&race, &first, claiming, commits).await;
        let out = claim.resume().await.unwrap();
        assert!(
            matches!(out, Err(Error::AlreadyHandled { .. })),
            "commits: {commits}: {out:?}"
        );
        assert_eq!(
            attempts_and_token(&pool, id).await,
            (JobStatus::Dead, 1, None),
            "commits: {commits}: the expired attempt counted once"
        );
        let late = job::complete(&pool, &holder, &json!("late")).await;
        assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
        let late = job::fail(&pool, &holder, "late", &RetryPolicy::default()).await;
        assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
        let late = job::heartbeat(&pool, &holder, LEASE).await;
        assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
        assert_eq!(
            reaper(&pool).run_once().await.unwrap(),
            ReapCounts::default()
        );
        let row = job::get(&pool, id).await.unwrap().unwrap();
        assert_eq!(
            row.last_error.as_deref(),
            Some("lease expired on the last of 1 attempts")
        );
    }
}

/// A claim names its job by id and takes it whatever its kind (the kind is
/// what `claim_batch` pollers ask for); a handler serving one kind reads
/// the kind first with `get`, and a job's kind stays what it was enqueued
/// with through claims, failures, the reaper and an operator's retry.
#[tokio::test]
async fn a_claim_by_id_takes_a_job_of_any_kind_whose_kind_never_changes() {
    let (_db, pool) = setup().await;
    let id = job::enqueue(&pool, &NewJob::new("invoice", json!({})).max_attempts(2))
        .await
        .unwrap();
    let kind = async || job::get(&pool, id).await.unwrap().unwrap().kind;
    assert!(
        job::claim_batch(&pool, "send", 10, LEASE)
            .await
            .unwrap()
            .is_empty(),
        "a poller of another kind passes it over"
    );
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    job::fail(&pool, &lease, "boom", &RetryPolicy::default())
        .await
        .unwrap();
    sqlx::query("UPDATE pgonce.jobs SET run_at = now() WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    job::claim(&pool, id, LEASE).await.unwrap();
    expire_lease(&pool, id).await;
    assert_eq!(reaper(&pool).run_once().await.unwrap().dead, 1);
    job::retry_dead(&mut pool.acquire().await.unwrap(), id, ALICE)
        .await
        .unwrap();
    assert_eq!(kind().await, "invoice");
}

/// The holder's write under `lease`: a heartbeat, its completion or its
/// failure.
async fn holders_write(
    db: &mut sqlx::PgConnection,
    lease: &job::Lease,
    write: &str,
) -> pgonce::Result<()> {
    match write {
        "heartbeat" => job::heartbeat(db, lease, LEASE).await.map(drop),
        "complete" => job::complete(db, lease, &json!("done")).await,
        _ => job::fail(db, lease, "boom", &RetryPolicy::default())
            .await
            .map(drop),
    }
}

/// A reaper pass and the holder's own write (heartbeat, complete, fail)
/// on a job whose lease ran out take turns on its row. The pass first,
/// held before its commit: the holder's write is seen waiting for the
/// reaper's session and, once the pass commits (the job pending, or dead
/// on its last attempt), hears its lease lost, writing nothing. The
/// holder first, in an open transaction: the pass skips the row, what the
/// holder commits stands (a heartbeat's lease is live again), and the next
/// pass finds nothing to reap.
#[tokio::test]
async fn the_reaper_and_the_holders_write_take_turns_on_an_expired_lease() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let gate = race.session("gate").await.unwrap();
    let reaping = race.session("reaper").await.unwrap();
    let holding = race.session("holder").await.unwrap();
    hold_passes_before_their_commit(&pool).await;
    for write in ["heartbeat", "complete", "fail"] {
        for max_attempts in [1, 3] {
            let what = format!("{write}, {max_attempts} attempts");
            let reaped = if max_attempts == 1 {
                JobStatus::Dead
            } else {
                JobStatus::Pending
            };

            // The reaper first.
            let (id, holder) = expired_job(&pool, max_attempts).await;
            let pass = reaper_pass_held(&race, &gate, &reaping).await;
            let holder_pool = holding.pool().clone();
            let written = race
                .step_blocks(&holding, write, async move {
                    let mut conn = holder_pool.acquire().await.unwrap();
                    holders_write(&mut conn, &holder, write).await
                })
                .await
                .unwrap();
            assert_eq!(written.blocked_by(), ["reaper"], "{what}");
            gate_runs(&race, &gate, "unlock", "SELECT pg_advisory_unlock(4242)").await;
            let counts = pass.resume().await.unwrap().unwrap();
            assert_eq!(counts.returned + counts.dead, 1, "{what}");
            let out = written.resume().await.unwrap();
            assert!(
                matches!(out, Err(Error::LeaseLost { .. })),
                "{what}: {out:?}"
            );
            assert_eq!(
                attempts_and_token(&pool, id).await,
                (reaped, 1, None),
                "{what}: the reaper's outcome stands"
            );

            // The holder first.
            let (id, holder) = expired_job(&pool, max_attempts).await;
            let mut writing = holding.pool().begin().await.unwrap();
            race.step(&holding, write, holders_write(&mut writing, &holder, write))
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("{what}: the lease is still the holder's: {e}"));
            let skipped = race
                .step(&reaping, "reap", reaper(reaping.pool()).run_once())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(
                skipped,
                ReapCounts::default(),
                "{what}: the pass skips the row"
            );
            end_step(&race, &holding, writing, true).await;
            assert_eq!(
                reaper(&pool).run_once().await.unwrap(),
                ReapCounts::default(),
                "{what}: nothing left to reap"
            );
            let held = match (write, max_attempts) {
                ("heartbeat", _) => (JobStatus::Processing, 0, Some(holder.token)),
                ("complete", _) => (JobStatus::Completed, 0, None),
                (_, 1) => (JobStatus::Dead, 1, None),
                _ => (JobStatus::Failed, 1, None),
            };
            assert_eq!(attempts_and_token(&pool, id).await, held, "{what}");
        }
    }
}

/// A stale holder's write under `lease` (`heartbeat`, `complete`, `fail`
/// or `complete_many`) at `point`: it must hear its lease lost, having
/// written nothing.
async fn stale_write_is_lost(
    db: &mut sqlx::PgConnection,
    lease: &job::Lease,
    write: &str,
    point: &str,
) {
    if write == "complete_many" {
        let lost = job::complete_many(db, &[(lease.clone(), json!("stale"))]).await;
        assert_eq!(lost.unwrap(), [lease.job_id], "{write}: {point}");
    } else {
        let out = holders_write(db, lease, write).await;
        assert!(
            matches!(out, Err(Error::LeaseLost { .. })),
            "{write}: {point}: {out:?}"
        );
    }
}

/// A holder whose expired lease another delivery took over writes at each
/// point of the new owner's run, and every write hears its lease lost,
/// writing nothing, while the new owner's own writes stand. The takeover
/// still open: the stale write is seen waiting for it, then lost once it
/// commits. Taken over: lost at once. The new owner's heartbeat, then its
/// completion or failure, held open: lost at once, without waiting (the
/// row's token is no longer the stale one). The new owner's failure
/// committed, the job re-claimed by a third delivery once due: lost.
#[tokio::test]
async fn a_stale_holder_hears_its_lease_lost_at_every_point_of_the_new_owners_run() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let stale = race.session("stale").await.unwrap();
    let owner = race.session("owner").await.unwrap();
    let writes = ["heartbeat", "complete", "fail", "complete_many"];
    for write in writes {
        for owner_fails in [false, true] {
            let what = format!("{write}, the owner fails: {owner_fails}");
            let (id, holder) = expired_job(&pool, 5).await;
            let lost_now = async |point: &str| {
                let mut conn = stale.pool().acquire().await.unwrap();
                let point = format!("{what}: {point}");
                race.step(
                    &stale,
                    write,
                    stale_write_is_lost(&mut conn, &holder, write, &point),
                )
                .await
                .unwrap();
            };

            // The takeover open: the stale write waits for it.
            let (taking, lease) = take_over_in_an_open_transaction(&race, &owner, id).await;
            let stale_pool = stale.pool().clone();
            let stale_lease = holder.clone();
            let point = format!("{what}: after the takeover");
            let waiting = race
                .step_blocks(&stale, write, async move {
                    let mut conn = stale_pool.acquire().await.unwrap();
                    stale_write_is_lost(&mut conn, &stale_lease, write, &point).await
                })
                .await
                .unwrap();
            assert_eq!(waiting.blocked_by(), ["owner"], "{what}");
            end_step(&race, &owner, taking, true).await;
            waiting.resume().await.unwrap();

            // Taken over.
            lost_now("taken over").await;

            // The owner's heartbeat, then its outcome, held open.
            let mut writing = owner.pool().begin().await.unwrap();
            race.step(
                &owner,
                "heartbeat",
                job::heartbeat(&mut *writing, &lease, LEASE),
            )
            .await
            .unwrap()
            .unwrap();
            lost_now("the owner's heartbeat open").await;
            let outcome = if owner_fails { "fail" } else { "complete" };
            race.step(
                &owner,
                outcome,
                holders_write(&mut writing, &lease, outcome),
            )
            .await
            .unwrap()
            .unwrap();
            lost_now("the owner's outcome open").await;
            end_step(&race, &owner, writing, true).await;
            lost_now("the owner's outcome committed").await;

            if owner_fails {
                assert_eq!(
                    attempts_and_token(&pool, id).await,
                    (JobStatus::Failed, 2, None),
                    "{what}"
                );
                sqlx::query("UPDATE pgonce.jobs SET run_at = now() WHERE id = $1")
                    .bind(id)
                    .execute(&pool)
                    .await
                    .unwrap();
                let third = job::claim(&pool, id, LEASE).await.unwrap();
                lost_now("a third delivery's claim").await;
                assert_eq!(
                    attempts_and_token(&pool, id).await,
                    (JobStatus::Processing, 2, Some(third.token)),
                    "{what}"
                );
                job::complete(&pool, &third, &json!("done")).await.unwrap();
            } else {
                let row = job::get(&pool, id).await.unwrap().unwrap();
                assert_eq!(
                    (
                        row.status().unwrap(),
                        row.attempts,
                        row.result.map(Result::unwrap)
                    ),
                    (JobStatus::Completed, 1, Some(json!("done"))),
                    "{what}: the owner's result stands"
                );
            }
        }
    }
}

/// A complete_many whose results' JSON text is within what one statement
/// may send, but whose leases are many: each lease sends its job id, token
/// and claiming transaction beside its result (49 bytes in all), and
/// 40,000 of them pass the margin PostgreSQL's 1 GiB message leaves. The
/// server dropped the connection; refused as bad input now, nothing
/// written.
#[tokio::test]
async fn complete_many_counts_what_each_lease_sends_beside_its_result() {
    let (_db, pool) = setup().await;
    const LEASES: usize = 40_000;
    sqlx::query(
        "INSERT INTO pgonce.jobs (kind, payload) \
         SELECT 'send', 'null' FROM generate_series(1, $1)",
    )
    .bind(LEASES as i32)
    .execute(&pool)
    .await
    .unwrap();
    let claimed = job::claim_batch(&pool, "send", LEASES as i64, LEASE)
        .await
        .unwrap();
    assert_eq!(claimed.len(), LEASES);
    // Each result's text: two quotes and six bytes (`\u0001`) a character.
    let chars = (pgonce::json::MAX_SENT_JSON_BYTES / LEASES - 2) / 6;
    let result = json!("\u{1}".repeat(chars));
    let done: Vec<(job::Lease, serde_json::Value)> = claimed
        .into_iter()
        .map(|c| (c.lease, result.clone()))
        .collect();
    let completed = job::complete_many(&pool, &done).await;
    assert!(
        matches!(&completed, Err(Error::Invalid { what: "job results", why }) if why.contains("1 GiB")),
        "complete_many: {:?}",
        completed.map_err(|e| format!("{e:?}"))
    );
    let processing: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgonce.jobs WHERE status = 'processing'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(processing, LEASES as i64, "nothing written");
}

/// A failure whose message is past what PostgreSQL takes in one message
/// (1 GiB) is recorded, its message cut at the last whole character
/// within what one statement sends: `fail` sent it whole and the server
/// dropped the connection, leaving the failure unrecorded, where a
/// failure's message must never keep it from being recorded.
#[tokio::test]
async fn a_failure_message_past_one_message_is_cut_and_recorded() {
    let (_db, pool) = setup().await;
    let id = job::enqueue(&pool, &NewJob::new("send", json!(null)))
        .await
        .unwrap();
    let lease = job::claim(&pool, id, LEASE).await.unwrap();
    // One byte, then three-byte characters past 1 GiB: the cut falls
    // inside a character, and goes back to the one before.
    let max = pgonce::json::MAX_SENT_JSON_BYTES;
    let error = format!("x{}", "€".repeat((1 << 30) / 3 + 10));
    let failed = job::fail(&pool, &lease, &error, &RetryPolicy::default()).await;
    drop(error);
    assert!(
        matches!(failed, Ok(job::FailOutcome::Retry { .. })),
        "fail: {:?}",
        failed.map_err(|e| e.to_string())
    );
    let stored: i32 = sqlx::query_scalar(
        "SELECT octet_length(last_error) FROM pgonce.jobs WHERE id = $1 AND status = 'failed'",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        stored as usize,
        1 + (max - 1) / 3 * 3,
        "cut at a whole character"
    );
}

/// A reaper whose database is down (a server of the test's own, stopped)
/// keeps passing every interval, and each failed pass counts in
/// `pgonce_service_failed_passes_total`; the log has the first at warn
/// with its error, then at most one warn line per minute of the outage,
/// the others at debug. Ten minutes of tokio's paused clock: the bounds
/// are read from that clock, not from how fast the machine runs. (Each
/// failed pass was logged at warn, a line per interval for as long as the
/// outage lasted, and counted nowhere.)
#[tokio::test]
async fn a_reaper_whose_database_is_down_logs_a_line_a_minute_and_counts_each_failed_pass() {
    // A short acquire timeout: a pass against the stopped server fails
    // within it.
    let (mut cluster, pool) =
        pgonce_testkit::own_migrated_cluster(2, Duration::from_secs(1), pgonce::migrate).await;
    let config = ReaperConfig {
        interval: Duration::from_secs(1),
        ..ReaperConfig::default()
    };
    let reaper = Reaper::new(pool.clone(), config).unwrap();
    reaper
        .run_once()
        .await
        .expect("a pass while the server runs");
    cluster.stop();

    let (metric, recorder) = support::count_of("pgonce_service_failed_passes_total");
    // On this single-threaded runtime the reaper's task records here too.
    let _local = metrics::set_default_local_recorder(&recorder);
    let logged = pgonce_testkit::logs::LogLines::default();
    let _logging = logged.capture();
    const OUTAGE: Duration = Duration::from_secs(600);
    tokio::time::pause();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(reaper.run(async {
        let _ = stopped.await;
    }));
    tokio::time::sleep(OUTAGE).await;
    stop.send(()).unwrap();
    running.await.unwrap();

    let failed = metric.load(Ordering::SeqCst);
    // A pass at least every other second (its interval, then its acquire
    // timeout at most): hundreds; some, whatever the jumps of the clock.
    assert!(failed >= 60, "the passes went on failing: {failed}");
    let first = logged.assert_run_of_failures(
        failed,
        OUTAGE,
        "reaper pass failed",
        "reaper passes still failing",
        None,
    );
    assert!(first.error.is_some(), "with its error: {first:?}");
    let still = logged.starting(tracing::Level::WARN, "reaper passes still failing");
    assert!(!still.is_empty(), "a line a minute while it goes on");
    drop(cluster);
}

/// A claim on a pool given up while it waits for another delivery's claim,
/// whose transaction then rolls back. The given-up claim's statement was
/// sent, so the server ran it once that transaction ended: the job was
/// claimed for nobody, and its message heard `JobBusy` until the lease ran
/// out, which then counted as a failed attempt (on the last one, the job
/// went dead). The lease must be given back before the connection serves
/// anyone else: the job pending, no attempt counted, the connection
/// outside any transaction.
#[tokio::test]
async fn a_claim_dropped_while_it_waits_gives_its_lease_back() {
    let (db, pool) = setup().await;
    let id = new_job(&pool, 5).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let ClaimBehindA {
        a,
        b,
        tx_a,
        waiting,
        ..
    } = claim_behind_a(&race, id).await;
    support::give_up_then_end(&race, waiting, (&a, tx_a.rollback()), &b).await;

    let redelivery = race
        .step(&b, "redelivery: claim", job::claim(b.pool(), id, LEASE))
        .await
        .unwrap();
    let Ok(lease) = redelivery else {
        panic!("the job of a claim given up is claimable at once, got {redelivery:?}");
    };
    assert_eq!(job::get(&pool, id).await.unwrap().unwrap().attempts, 0);
    job::complete(&pool, &lease, &json!("done")).await.unwrap();
}

/// A `claim_batch` on a pool given up while its COMMIT is on its way: the
/// server commits it anyway, and its jobs were claimed for nobody, each
/// `processing` until its lease ran out, which then counted as a failed
/// attempt. The COMMIT is held at a gate for the step: a deferred trigger
/// on the jobs table takes an advisory lock that A holds, so B's COMMIT is
/// seen waiting for A in `pg_blocking_pids`. The leases must be given back
/// before the connection serves anyone else: the next poll claims the jobs
/// with no attempt counted.
#[tokio::test]
async fn a_claim_batch_dropped_while_it_commits_gives_its_leases_back() {
    let (db, pool) = setup().await;
    let ids = [new_job(&pool, 5).await, new_job(&pool, 5).await];
    sqlx::raw_sql(
        "CREATE FUNCTION commit_gate() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER commit_gate AFTER UPDATE ON pgonce.jobs \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION commit_gate();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let support::HolderAndWaiter { race, a, b, tx_a } = support::a_holding(
        db.options(),
        "hold the commit gate",
        "SELECT pg_advisory_xact_lock(4242)",
    )
    .await;
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "claim_batch, then COMMIT", async move {
            job::claim_batch(&pool_b, "send", 10, LEASE).await
        })
        .await
        .unwrap();
    support::give_up_then_end(&race, waiting, (&a, tx_a.commit()), &b).await;

    let next_poll = race
        .step(
            &b,
            "next poll",
            job::claim_batch(b.pool(), "send", 10, LEASE),
        )
        .await
        .unwrap()
        .unwrap();
    let mut claimed: Vec<i64> = next_poll.iter().map(|j| j.lease.job_id).collect();
    claimed.sort_unstable();
    assert_eq!(
        claimed, ids,
        "the given-up batch's jobs are claimable at once"
    );
    for job in &next_poll {
        assert_eq!(job.attempts, 0);
        job::complete(&pool, &job.lease, &json!("done"))
            .await
            .unwrap();
    }
}
