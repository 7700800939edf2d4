//! The worker runtime on the PostgreSQL queue, where its promises meet the
//! database: a handler keeps running while its heartbeat waits on the
//! database, a handler that panics is a failure like any other, and a
//! shutdown leaves no message waiting out a visibility timeout.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use pgonce::job::JobStatus;
use pgonce::{
    Handler, HandlerError, PgQueue, PgQueueOptions, Queue, QueueAttributes, ReceiveRequest,
    Received, SendMessage, Worker, WorkerConfig,
};
use pgonce_testkit::logs::LogLines;
use pgonce_testkit::{FAILSAFE, fresh_migrated_database};
use sqlx::PgPool;
use tokio::sync::Notify;

mod support;

async fn queue(pool: &PgPool, name: &str) -> PgQueue {
    PgQueue::create(
        pool,
        name,
        QueueAttributes::default(),
        PgQueueOptions::default(),
    )
    .await
    .unwrap()
}

/// Announces that it started, waits to be let go, announces that it
/// finished.
#[derive(Default)]
struct Gated {
    started: Notify,
    go: Notify,
    finished: Notify,
}

/// The handler side of a [`Gated`].
struct Gate(Arc<Gated>);

impl Handler for Gate {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        self.0.started.notify_one();
        self.0.go.notified().await;
        self.0.finished.notify_one();
        Ok(())
    }
}

/// A [`Gate`] per message body: each message's handler waits for its own.
struct GateByBody(HashMap<&'static str, Arc<Gated>>);

impl Handler for GateByBody {
    async fn handle(&self, m: &Received) -> Result<(), HandlerError> {
        Gate(self.0[m.body.as_str()].clone()).handle(m).await
    }
}

/// Two calls of one worker running at once each return what they did, not
/// what the other did meanwhile. Step by step: the first call's handler
/// (of `a`) is held; the second call receives `b`, whose handler is held
/// while `a`'s is let go and the first call returns; then `b`'s is let go.
/// (A call returned the difference of the worker's counters over its
/// time: the first counted `b`'s delivery as its own, the second `a`'s
/// success and delete.)
#[tokio::test]
async fn two_calls_at_once_each_return_what_they_did() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let q = queue(&pool, "q").await;
    let (a, b) = (Arc::new(Gated::default()), Arc::new(Gated::default()));
    let handler = GateByBody(HashMap::from([("a", a.clone()), ("b", b.clone())]));
    let config = hour_long(WorkerConfig {
        concurrency: 1,
        batch: 1,
        ..WorkerConfig::default()
    });
    let worker = Arc::new(Worker::new(q.clone(), handler, config).unwrap());
    let run_once = || {
        let worker = worker.clone();
        tokio::spawn(async move { worker.run_once().await.unwrap() })
    };
    let done = |c: pgonce::WorkerCounters| (c.received, c.succeeded, c.deleted);
    q.send(SendMessage::new("a")).await.unwrap();
    let first = run_once();
    tokio::time::timeout(FAILSAFE, a.started.notified())
        .await
        .expect("a's handler started");
    q.send(SendMessage::new("b")).await.unwrap();
    let second = run_once();
    tokio::time::timeout(FAILSAFE, b.started.notified())
        .await
        .expect("b's handler started");
    a.go.notify_one();
    let first = tokio::time::timeout(FAILSAFE, first)
        .await
        .expect("the first call ends")
        .unwrap();
    b.go.notify_one();
    let second = tokio::time::timeout(FAILSAFE, second)
        .await
        .expect("the second call ends")
        .unwrap();
    assert_eq!(
        (done(first), done(second)),
        ((1, 1, 1), (1, 1, 1)),
        "each call its own message: {first:?}, {second:?}"
    );
    assert_eq!(done(worker.counters()), (2, 2, 2), "the worker both");
}

/// Backends waiting on a lock `holder` holds.
async fn blocked_by(observer: &PgPool, holder: i32) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
    )
    .bind(holder)
    .fetch_one(observer)
    .await
    .unwrap()
}

/// A connection holding a message's row lock in an open transaction.
struct RowHolder {
    conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
    /// Its backend, which the waiting heartbeat is blocked by.
    pid: i32,
}

/// Locks message `id`'s row in a transaction on a connection of its own,
/// and returns it once a statement (a heartbeat) is seen waiting on the
/// lock.
async fn hold_until_a_beat_waits(pool: &sqlx::PgPool, id: &str) -> RowHolder {
    let holder = hold_row(pool, id).await;
    until_blocked_by(pool, holder.pid, "a heartbeat waits on the row lock").await;
    holder
}

/// Waits until a statement is seen waiting on a lock `holder` holds.
async fn until_blocked_by(pool: &sqlx::PgPool, holder: i32, what: &str) {
    tokio::time::timeout(FAILSAFE, async {
        while blocked_by(pool, holder).await == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect(what);
}

/// Locks message `id`'s row in a transaction on a connection of its own.
async fn hold_row(pool: &sqlx::PgPool, id: &str) -> RowHolder {
    let mut holder = pool.acquire().await.unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut *holder).await.unwrap();
    sqlx::query("SELECT 1 FROM pgonce.queue_message WHERE id = $1 FOR UPDATE")
        .bind(id.parse::<i64>().unwrap())
        .execute(&mut *holder)
        .await
        .unwrap();
    RowHolder {
        conn: holder,
        pid: holder_pid,
    }
}

/// A heartbeat is a database statement, and a statement can wait (on a row
/// lock, on a connection of an exhausted pool). The handler must keep
/// running meanwhile: it may be the very thing that frees what the beat
/// waits for, and it is the work the beat exists to protect.
#[tokio::test]
async fn a_heartbeat_waiting_in_the_database_does_not_stall_its_handler() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let q = queue(&pool, "q").await;
    let sent = q.send(SendMessage::new("m")).await.unwrap();
    let gated = Arc::new(Gated::default());
    let config = WorkerConfig {
        concurrency: 1,
        batch: 1,
        heartbeat_interval: Some(Duration::from_millis(50)),
        heartbeat_extension: Duration::from_secs(30),
        ..WorkerConfig::default()
    };
    let worker = Arc::new(Worker::new(q.clone(), Gate(gated.clone()), config).unwrap());
    let run = tokio::spawn({
        let worker = worker.clone();
        async move { worker.run_once().await }
    });
    tokio::time::timeout(FAILSAFE, gated.started.notified())
        .await
        .expect("the handler started");

    // Lock the message's row, and wait until a heartbeat is seen waiting on it.
    let mut holder = hold_until_a_beat_waits(&pool, &sent.id).await;

    // Let the handler go: it must finish while the beat still waits.
    gated.go.notify_one();
    let finished = tokio::time::timeout(FAILSAFE, gated.finished.notified()).await;
    let still_blocked = blocked_by(&pool, holder.pid).await;
    sqlx::query("ROLLBACK")
        .execute(&mut *holder.conn)
        .await
        .unwrap();
    assert!(
        finished.is_ok(),
        "the handler made no progress while its heartbeat waited on a row lock \
         ({still_blocked} backend(s) still waiting)"
    );
    let done = tokio::time::timeout(FAILSAFE, run)
        .await
        .expect("run_once ends once the lock is gone")
        .unwrap()
        .unwrap();
    assert_eq!((done.succeeded, done.deleted), (1, 1));
}

/// Panics on every delivery.
struct Panics;

impl Handler for Panics {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        panic!("the handler panics on purpose");
    }
}

/// A handler that panics failed: its message is kept and made visible again
/// after `failure_visibility`, as after an `Err`, instead of waiting out the
/// (here hour-long) visibility timeout.
#[tokio::test]
async fn a_handler_that_panics_gets_its_failure_visibility() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let q = queue(&pool, "q").await;
    q.send(SendMessage::new("m")).await.unwrap();
    let config = WorkerConfig {
        visibility: Some(Duration::from_secs(3600)),
        heartbeat_interval: None,
        failure_visibility: Some(Duration::ZERO),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(q.clone(), Panics, config).unwrap();
    let done = worker.run_once().await.unwrap();
    assert_eq!((done.received, done.failed, done.deleted), (1, 1, 0));
    receivable_now(
        &q,
        2,
        "the message of a panicked handler is receivable again at once",
    )
    .await;
}

/// A handler's own error, wrapping what caused it (its `source`).
#[derive(Debug)]
struct Wrapped(pgonce::Error);

impl std::fmt::Display for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "processing the message failed")
    }
}

impl std::error::Error for Wrapped {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// Finds its job in another delivery's hands for an hour, and says so in
/// its own error type.
struct BusyInside;

impl Handler for BusyInside {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        Err(Box::new(Wrapped(pgonce::Error::JobBusy {
            job_id: 1,
            status: pgonce::job::JobStatus::Processing,
            not_before: time::OffsetDateTime::now_utc() + time::Duration::hours(1),
        })))
    }
}

/// A handler's error caused by [`pgonce::Error::JobBusy`] keeps the message
/// whatever the policy, however the handler wrapped it: if the job's holder
/// dies, this message is what drives the reaped job.
#[tokio::test]
async fn a_job_busy_wrapped_in_the_handlers_own_error_keeps_the_message() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let q = queue(&pool, "q").await;
    q.send(SendMessage::new("m")).await.unwrap();
    let config = WorkerConfig {
        ack: pgonce::AckPolicy::AlwaysDelete,
        ..WorkerConfig::default()
    };
    let worker = Worker::new(q.clone(), BusyInside, config).unwrap();
    let done = worker.run_once().await.unwrap();
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM pgonce.queue_message")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        (done.failed, done.deleted, kept),
        (1, 0, 1),
        "the message of a busy job is kept"
    );
}

/// Does a job's work in a REPEATABLE READ transaction whose snapshot was
/// taken before the job was claimed on the pool: completing in it is a
/// serialization failure (SQLSTATE 40001), which the handler returns.
struct ClaimsAfterItsSnapshot {
    pool: PgPool,
    job_id: i64,
}

impl Handler for ClaimsAfterItsSnapshot {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        let mut work = pgonce::begin(&self.pool, pgonce::IsolationLevel::RepeatableRead).await?;
        sqlx::query("SELECT count(*) FROM pgonce.jobs")
            .execute(&mut *work)
            .await?;
        let lease = pgonce::job::claim(&self.pool, self.job_id, Duration::from_secs(60)).await?;
        pgonce::job::complete(&mut *work, &lease, &serde_json::json!("done")).await?;
        work.commit().await?;
        Ok(())
    }
}

/// Queue `q` with one message, and a pending job for it to drive.
async fn a_job_and_its_message(pool: &PgPool) -> (PgQueue, i64) {
    let q = queue(pool, "q").await;
    q.send(SendMessage::new("job")).await.unwrap();
    let job_id = pgonce::job::enqueue(
        pool,
        &pgonce::job::NewJob::new("send", serde_json::json!({})),
    )
    .await
    .unwrap();
    (q, job_id)
}

/// `AlwaysDelete`, with a kept message visible again at once.
fn always_delete_failures_back_at_once() -> WorkerConfig {
    WorkerConfig {
        ack: pgonce::AckPolicy::AlwaysDelete,
        failure_visibility: Some(Duration::ZERO),
        ..WorkerConfig::default()
    }
}

/// A transaction PostgreSQL aborted to keep it serializable recorded
/// nothing: under `AlwaysDelete`, where the database is the retry ledger,
/// the message is all that still drives the job, and must be kept (as for a
/// panic). It was deleted, and with the claim's lease reaped the job sat
/// pending with no message to run it.
#[tokio::test]
async fn a_serialization_failure_keeps_the_message_under_always_delete() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (q, job_id) = a_job_and_its_message(&pool).await;
    let config = always_delete_failures_back_at_once();
    let handler = ClaimsAfterItsSnapshot {
        pool: pool.clone(),
        job_id,
    };
    let worker = Worker::new(q.clone(), handler, config).unwrap();
    let done = worker.run_once().await.unwrap();
    assert_eq!((done.failed, done.deleted), (1, 0), "the message is kept");
    receivable_now(&q, 2, "the message of a transaction to retry comes back").await;
    assert!(!pgonce::AckPolicy::AlwaysDelete.delete_message::<()>(&Err(
        pgonce::Error::SerializationFailure {
            sqlstate: "40001".into(),
            message: "could not serialize access".into(),
        }
    )));
}

/// Claims the job its message names. The first delivery's work meets a
/// serialization failure (completing in a REPEATABLE READ transaction whose
/// snapshot predates the claim, a real 40001), records it with
/// `job::fail` and returns it as a [`pgonce::job::FailureRecorded`];
/// later deliveries complete the job. Counts its deliveries.
struct FailsOnceOnASerializationFailure {
    pool: PgPool,
    deliveries: std::sync::atomic::AtomicU64,
}

impl Handler for FailsOnceOnASerializationFailure {
    async fn handle(&self, m: &Received) -> Result<(), HandlerError> {
        let job_id: i64 = m.body.parse()?;
        let delivery = 1 + self
            .deliveries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut work = pgonce::begin(&self.pool, pgonce::IsolationLevel::RepeatableRead).await?;
        sqlx::query("SELECT count(*) FROM pgonce.jobs")
            .execute(&mut *work)
            .await?;
        let lease = match pgonce::job::claim(&self.pool, job_id, Duration::from_secs(60)).await {
            Ok(lease) => lease,
            Err(pgonce::Error::AlreadyHandled { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if delivery > 1 {
            work.rollback().await?;
            pgonce::job::complete(&self.pool, &lease, &serde_json::json!("done")).await?;
            return Ok(());
        }
        let cause = pgonce::job::complete(&mut *work, &lease, &serde_json::json!("done"))
            .await
            .expect_err("the work's snapshot predates the claim");
        assert!(cause.is_retryable(), "{cause:?}");
        work.rollback().await?;
        Err(failure_recorded(&self.pool, &lease, cause).await?)
    }
}

/// Records `cause` as the failure of `lease`'s attempt with `fail`, and
/// returns it as the handler reports it: a `FailureRecorded`.
async fn failure_recorded(
    pool: &PgPool,
    lease: &pgonce::job::Lease,
    cause: pgonce::Error,
) -> Result<HandlerError, HandlerError> {
    let outcome = pgonce::job::fail(
        pool,
        lease,
        &cause.to_string(),
        &pgonce::job::RetryPolicy::default(),
    )
    .await?;
    Ok(Box::new(pgonce::job::FailureRecorded::new(
        lease.job_id,
        outcome,
        cause,
    )))
}

/// Messages in the queue's table, visible or not.
async fn messages(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgonce.queue_message")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Under `AlwaysDelete` a failed attempt's retry is driven by the row: the
/// re-driver makes the job pending once due, and its ids are published. A
/// handler that recorded its failure, caused by a serialization failure,
/// had its message kept all the same (a retryable error recorded nothing,
/// the worker assumed), so the retry had two messages, the kept one and
/// the re-driver's, and the job was delivered three times for two
/// attempts. The recorded failure deletes the message now: one delivery
/// per attempt.
#[tokio::test]
async fn a_recorded_failure_is_delivered_once_per_attempt_under_always_delete() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let q = queue(&pool, "q").await;
    let job_id = pgonce::job::enqueue(
        &pool,
        &pgonce::job::NewJob::new("send", serde_json::json!({})),
    )
    .await
    .unwrap();
    q.send(SendMessage::new(job_id.to_string())).await.unwrap();
    let handler = FailsOnceOnASerializationFailure {
        pool: pool.clone(),
        deliveries: Default::default(),
    };
    let worker = Worker::new(q.clone(), handler, always_delete_failures_back_at_once()).unwrap();
    let first = worker.run_once().await.unwrap();
    assert_eq!(first.failed, 1);
    // The retry comes due; the re-driver's pass publishes a message per id.
    sqlx::query("UPDATE pgonce.jobs SET run_at = now() - interval '1 second' WHERE id = $1")
        .bind(job_id)
        .execute(&pool)
        .await
        .unwrap();
    let redriver =
        pgonce::job::Redriver::new(pool.clone(), pgonce::job::RedriverConfig::default()).unwrap();
    let ids = redriver.run_once().await.unwrap().ids;
    assert_eq!(ids, [job_id]);
    for id in ids {
        q.send(SendMessage::new(id.to_string())).await.unwrap();
    }
    assert_eq!(messages(&pool).await, 1, "one message drives the retry");
    while worker.run_once().await.unwrap().received > 0 {}
    let deliveries = worker
        .handler()
        .deliveries
        .load(std::sync::atomic::Ordering::Relaxed);
    let job = pgonce::job::get(&pool, job_id).await.unwrap().unwrap();
    assert_eq!(
        (deliveries, job.status().unwrap(), job.attempts),
        (2, pgonce::job::JobStatus::Completed, 1),
        "one delivery per attempt"
    );
    assert_eq!(messages(&pool).await, 0);
}

/// Claims its job on a connection of its own whose session has a
/// `lock_timeout` (as an operator's `ALTER ROLE ... SET lock_timeout` gives
/// it), and returns the claim's error.
struct ClaimsUnderATimeout {
    pool: PgPool,
    job_id: i64,
    /// `lock_timeout` or `statement_timeout`, set to 100 ms for the claim.
    setting: &'static str,
}

impl Handler for ClaimsUnderATimeout {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        let mut conn = self.pool.acquire().await?;
        sqlx::query("SELECT set_config($1, '100ms', false)")
            .bind(self.setting)
            .execute(&mut *conn)
            .await?;
        let claimed = pgonce::job::claim(&mut *conn, self.job_id, Duration::from_secs(60)).await;
        // Back to no bound, as the test database has it.
        sqlx::query("SELECT set_config($1, '0', false)")
            .bind(self.setting)
            .execute(&mut *conn)
            .await?;
        claimed?;
        Ok(())
    }
}

/// A claim that gave up waiting for the job's row past the session's
/// `lock_timeout` (or `statement_timeout`) wrote nothing: under
/// `AlwaysDelete` its message, which the job module says a worker keeps
/// then, is all that drives the job once the row's holder rolls back. It
/// was deleted, and the job sat pending with no message.
#[tokio::test]
async fn a_claim_past_the_lock_timeout_keeps_the_message_under_always_delete() {
    a_claim_past_a_timeout_keeps_the_message("lock_timeout").await;
}

/// [`a_claim_past_the_lock_timeout_keeps_the_message_under_always_delete`],
/// with the wait cut by `statement_timeout` ([`pgonce::Error::QueryCanceled`]).
#[tokio::test]
async fn a_claim_past_the_statement_timeout_keeps_the_message_under_always_delete() {
    a_claim_past_a_timeout_keeps_the_message("statement_timeout").await;
}

async fn a_claim_past_a_timeout_keeps_the_message(setting: &'static str) {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (q, job_id) = a_job_and_its_message(&pool).await;
    // Another transaction holds the job's row until the end.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM pgonce.jobs WHERE id = $1 FOR UPDATE")
        .bind(job_id)
        .execute(&mut *holder)
        .await
        .unwrap();
    let config = always_delete_failures_back_at_once();
    let handler = ClaimsUnderATimeout {
        pool: pool.clone(),
        job_id,
        setting,
    };
    let worker = Worker::new(q.clone(), handler, config).unwrap();
    let done = worker.run_once().await.unwrap();
    assert_eq!(
        (done.failed, done.deleted),
        (1, 0),
        "{setting}: the message is kept"
    );
    holder.rollback().await.unwrap();
    receivable_now(&q, 2, "the message of a claim that gave up comes back").await;
    let cut = if setting == "lock_timeout" {
        pgonce::Error::LockNotAvailable {
            message: "canceling statement due to lock timeout".into(),
        }
    } else {
        pgonce::Error::QueryCanceled {
            message: "canceling statement due to statement timeout".into(),
        }
    };
    assert!(!pgonce::AckPolicy::AlwaysDelete.delete_message::<()>(&Err(cut)));
}

/// [`Gate`], but fails.
struct GatedFailure(Arc<Gated>);

impl Handler for GatedFailure {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        self.0.started.notify_one();
        self.0.go.notified().await;
        self.0.finished.notify_one();
        Err("failed on purpose".into())
    }
}

/// A beat in flight when its handler ends is finished before the ack, not
/// dropped: dropped, its statement could still reach the database after the
/// ack's, and extend the visibility the ack had just set (here: release the
/// message at once, `failure_visibility` zero).
#[tokio::test]
async fn a_heartbeat_in_flight_when_the_handler_ends_lands_before_the_ack() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let q = queue(&pool, "q").await;
    let sent = q.send(SendMessage::new("m")).await.unwrap();
    let gated = Arc::new(Gated::default());
    let config = WorkerConfig {
        concurrency: 1,
        batch: 1,
        heartbeat_interval: Some(Duration::from_millis(50)),
        heartbeat_extension: Duration::from_secs(3600),
        failure_visibility: Some(Duration::ZERO),
        ..WorkerConfig::default()
    };
    let worker = Arc::new(Worker::new(q.clone(), GatedFailure(gated.clone()), config).unwrap());
    let run = tokio::spawn({
        let worker = worker.clone();
        async move { worker.run_once().await }
    });
    tokio::time::timeout(FAILSAFE, gated.started.notified())
        .await
        .expect("the handler started");
    let mut holder = hold_until_a_beat_waits(&pool, &sent.id).await;
    let beats_before = worker.counters().heartbeats;
    // The handler ends while the beat waits (on this single-threaded
    // runtime, the worker's task has gone on to its ack, or to the beat,
    // before this task runs again).
    gated.go.notify_one();
    tokio::time::timeout(FAILSAFE, gated.finished.notified())
        .await
        .expect("the handler ended");
    sqlx::query("ROLLBACK")
        .execute(&mut *holder.conn)
        .await
        .unwrap();
    let done = tokio::time::timeout(FAILSAFE, run)
        .await
        .expect("run_once ends once the lock is gone")
        .unwrap()
        .unwrap();
    assert_eq!(
        (done.failed, done.heartbeats),
        (1, beats_before + 1),
        "the beat in flight was finished, then the ack"
    );
    let again = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(again.len(), 1, "released by the ack after the beat");
}

/// Runs `worker` until `stop` fires, and `drive` beside it, which fires it
/// (and may go on after); what the run did.
async fn run_beside<Q: Queue + 'static, H: Handler>(
    worker: &Worker<Q, H>,
    stop: tokio::sync::oneshot::Receiver<()>,
    drive: impl std::future::Future<Output = ()>,
) -> pgonce::WorkerCounters {
    let run = worker.run(async {
        let _ = stop.await;
    });
    let (done, ()) = tokio::time::timeout(FAILSAFE * 2, futures::future::join(run, drive))
        .await
        .expect("run ends");
    done
}

/// No heartbeat, deliveries invisible for an hour: a message that waits
/// out its visibility timeout is visibly lost to the test.
fn hour_long(config: WorkerConfig) -> WorkerConfig {
    WorkerConfig {
        visibility: Some(Duration::from_secs(3600)),
        heartbeat_interval: None,
        ..config
    }
}

/// A queue with one message, and a worker of one [`Gate`]d handler at a
/// time whose shutdown deadline is zero: a handler still running at the
/// shutdown is abandoned.
async fn one_gated_message_no_deadline(
    pool: &PgPool,
) -> (PgQueue, pgonce::Sent, Arc<Gated>, Worker<PgQueue, Gate>) {
    one_gated_message(pool, Duration::ZERO).await
}

/// A queue with one message, and a worker of one [`Gate`]d handler at a
/// time with this `shutdown_deadline`.
async fn one_gated_message(
    pool: &PgPool,
    shutdown_deadline: Duration,
) -> (PgQueue, pgonce::Sent, Arc<Gated>, Worker<PgQueue, Gate>) {
    let gated = Arc::new(Gated::default());
    let (q, sent, worker) = one_message(pool, Gate(gated.clone()), shutdown_deadline).await;
    (q, sent, gated, worker)
}

/// A queue with one message, and a worker of one `handler` at a time
/// with this `shutdown_deadline`.
async fn one_message<H: Handler>(
    pool: &PgPool,
    handler: H,
    shutdown_deadline: Duration,
) -> (PgQueue, pgonce::Sent, Worker<PgQueue, H>) {
    let q = queue(pool, "q").await;
    let sent = q.send(SendMessage::new("m")).await.unwrap();
    let config = hour_long(WorkerConfig {
        concurrency: 1,
        batch: 1,
        shutdown_deadline,
        ..WorkerConfig::default()
    });
    let worker = Worker::new(q.clone(), handler, config).unwrap();
    (q, sent, worker)
}

/// The one message of `q`, receivable now, at its `receive_count`th
/// delivery; else what the receive found.
async fn receivable_now(q: &PgQueue, receive_count: u32, what: &str) {
    let again = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(
        again.iter().map(|m| m.receive_count).collect::<Vec<_>>(),
        [receive_count],
        "{what}"
    );
}

/// A handler abandoned at the shutdown deadline is no longer running: the
/// in-flight gauge must not go on counting it once the worker is gone, and
/// its message is handed back at once, not after its (hour-long)
/// visibility timeout.
#[tokio::test]
async fn an_abandoned_handler_leaves_the_in_flight_gauge_and_its_message() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (q, _sent, gated, worker) = one_gated_message_no_deadline(&pool).await;
    let (in_flight, recorder) = support::gauge_of("pgonce_queue_worker_in_flight");
    // On this single-threaded runtime the worker's tasks record here too.
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut while_running = None;
    let done = tokio::time::timeout(
        FAILSAFE,
        worker.run(async {
            gated.started.notified().await;
            while_running = Some(in_flight());
        }),
    )
    .await
    .expect("run ends at the deadline");
    assert_eq!(
        (while_running, done.abandoned),
        (Some(1.0), 1),
        "the handler ran and was abandoned"
    );
    assert_eq!(
        in_flight(),
        0.0,
        "the gauge still counts the abandoned handler after the worker is gone"
    );
    receivable_now(
        &q,
        2,
        "the abandoned handler's message is handed back at once",
    )
    .await;
}

/// Asks `query` (a boolean) again until it says true.
async fn until_true(pool: &PgPool, query: &'static str, what: &str) {
    tokio::time::timeout(FAILSAFE, async {
        while !sqlx::query_scalar::<_, bool>(query)
            .fetch_one(pool)
            .await
            .unwrap()
        {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect(what);
}

/// The advisory lock a delivery of a message whose body is `gate` waits
/// for (a trigger [`GATE_DELIVERIES`] installs).
const DELIVERY_GATE: i64 = 4242;

/// Makes every update of a message whose body is `gate` (its delivery,
/// first) wait for advisory lock [`DELIVERY_GATE`] (4242).
const GATE_DELIVERIES: &str = "
CREATE FUNCTION public.gate_delivery() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(4242);
    RETURN NEW;
END $$;
CREATE TRIGGER gate_delivery BEFORE UPDATE ON pgonce.queue_message
    FOR EACH ROW WHEN (NEW.body = 'gate') EXECUTE FUNCTION public.gate_delivery();";

/// Bodies, sorted.
fn bodies(messages: &[Received]) -> Vec<&str> {
    let mut bodies: Vec<&str> = messages.iter().map(|m| m.body.as_str()).collect();
    bodies.sort_unstable();
    bodies
}

/// A shutdown that comes while a receive's statement runs lets the receive
/// finish and hands back at once what it delivered. Dropped, the receive
/// took with it what its earlier statement had already delivered, and
/// committed: that message waited out its hour-long visibility timeout.
///
/// Step by step: the receive's first statement drops an expired message
/// and delivers `a`; as it left a place of its batch of two unfilled, a
/// second statement looks further and finds `gate`, whose delivery waits
/// on a lock the test holds (a trigger). Once that wait is seen in
/// `pg_locks`: the shutdown, then the lock is let go.
#[tokio::test]
async fn a_shutdown_during_a_receive_hands_what_it_delivered_back() {
    let (_db, pool) = fresh_migrated_database(8, pgonce::migrate).await;
    let q = queue(&pool, "q").await;
    sqlx::raw_sql(GATE_DELIVERIES).execute(&pool).await.unwrap();
    // In the order a receive picks them: the earliest visible first.
    for (body, ago) in [("expired", "5 days"), ("a", "1 day"), ("gate", "1 hour")] {
        sqlx::query(
            "INSERT INTO pgonce.queue_message (queue, body, sent_at, visible_at)
             VALUES ('q', $1, now() - $2::interval, now() - $2::interval)",
        )
        .bind(body)
        .bind(ago)
        .execute(&pool)
        .await
        .unwrap();
    }
    let mut gate = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(DELIVERY_GATE)
        .execute(&mut *gate)
        .await
        .unwrap();
    let config = hour_long(WorkerConfig {
        concurrency: 2,
        batch: 2,
        wait: Duration::from_secs(5),
        shutdown_deadline: FAILSAFE,
        ..WorkerConfig::default()
    });
    let worker = Worker::new(q.clone(), Gate(Arc::default()), config).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let drive = async {
        let waiting = "SELECT count(*) > 0 FROM pg_locks
             WHERE locktype = 'advisory' AND NOT granted AND objid = 4242";
        until_true(
            &pool,
            waiting,
            "the receive's second statement waits on the gate",
        )
        .await;
        // The worker sees the shutdown before the receive can end: its
        // statement waits for the unlock below, and the shutdown is
        // looked at first.
        stop_tx.send(()).unwrap();
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(DELIVERY_GATE)
            .execute(&mut *gate)
            .await
            .unwrap();
    };
    let done = run_beside(&worker, stop_rx, drive).await;
    // However the run ended, the receive's statements are over before the
    // messages are looked at: a gated one still running would hold its
    // row, which a receive skips.
    let over = "SELECT count(*) = 0 FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
           AND state = 'active' AND query LIKE '%pgonce.queue_message%'";
    until_true(&pool, over, "the receive's statements end").await;
    assert_eq!(done.received, 0, "nothing handled after the shutdown");
    let again = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(
        bodies(&again),
        ["a", "gate"],
        "what the receive delivered after the shutdown is receivable at once"
    );
}

/// A shutdown that comes while the worker is parked in a long poll (here
/// an hour long) ends it at once: nothing was delivered, nothing to wait
/// for.
#[tokio::test]
async fn a_shutdown_while_parked_in_a_long_poll_ends_it_at_once() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let q = queue(&pool, "q").await;
    let config = hour_long(WorkerConfig {
        concurrency: 1,
        batch: 1,
        wait: Duration::from_secs(3600),
        ..WorkerConfig::default()
    });
    let worker = Worker::new(q.clone(), Gate(Arc::default()), config).unwrap();
    let done = tokio::time::timeout(
        FAILSAFE,
        worker.run(async {
            while q.parked_receivers() == 0 {
                tokio::task::yield_now().await;
            }
        }),
    )
    .await
    .expect("the parked receive gives up at the shutdown");
    assert_eq!(done, pgonce::WorkerCounters::default());
}

/// A handler that finished before the shutdown deadline has its ack
/// finished after it, not dropped: here the ack (a delete) waits on the
/// message's row lock as the deadline (zero) passes, and the message is
/// deleted once the lock is let go, not abandoned.
#[tokio::test]
async fn an_ack_under_way_at_the_shutdown_deadline_is_finished() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (_q, sent, gated, worker) = one_gated_message_no_deadline(&pool).await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let drive = async {
        tokio::time::timeout(FAILSAFE, gated.started.notified())
            .await
            .expect("the handler started");
        let mut holder = hold_row(&pool, &sent.id).await;
        gated.go.notify_one();
        until_blocked_by(&pool, holder.pid, "the ack waits on the row lock").await;
        stop_tx.send(()).unwrap();
        sqlx::query("ROLLBACK")
            .execute(&mut *holder.conn)
            .await
            .unwrap();
    };
    let done = run_beside(&worker, stop_rx, drive).await;
    assert_eq!(
        (done.succeeded, done.deleted, done.abandoned),
        (1, 1, 0),
        "the ack under way was finished"
    );
}

/// A shutdown deadline too long to reach (here `Duration::MAX`: wait for
/// the handlers however long they take) is waited for, not added to the
/// clock: that overflowed and panicked as the shutdown began, dropping the
/// handlers still running with the run.
#[tokio::test]
async fn a_shutdown_deadline_past_the_end_of_time_waits_for_the_handler() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (_q, _sent, gated, worker) = one_gated_message(&pool, Duration::MAX).await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let drive = async {
        tokio::time::timeout(FAILSAFE, gated.started.notified())
            .await
            .expect("the handler started");
        stop_tx.send(()).unwrap();
        // Whether the run sees the shutdown before the handler ends or
        // after, the deadline is out of reach: the handler is waited for.
        gated.go.notify_one();
    };
    let done = run_beside(&worker, stop_rx, drive).await;
    assert_eq!(
        (done.succeeded, done.deleted, done.abandoned),
        (1, 1, 0),
        "the handler was waited for and acked"
    );
}

/// Pending when first polled (and asks to be polled again), ready from
/// the next poll on: a shutdown that comes between two looks of the
/// worker's, as one raised from another thread can.
#[derive(Default)]
struct ReadyOnSecondPoll {
    polled: bool,
}

impl std::future::Future for ReadyOnSecondPoll {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.polled {
            return std::task::Poll::Ready(());
        }
        self.polled = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

/// A shutdown that comes after the worker took a handler slot but before
/// its receive was first polled starts no receive: the receive has not
/// asked the queue for anything, and started after the shutdown it
/// delivered a message only to hand it back, one more delivery on its
/// receive count (toward the dead-letter queue) for nothing.
///
/// Step by step: the worker looks at the shutdown (pending), takes a
/// slot, builds its receive and looks at the shutdown again (ready now)
/// before polling the receive.
#[tokio::test]
async fn a_shutdown_before_the_receive_is_polled_delivers_nothing() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (q, _sent, worker) = one_message(&pool, Gate(Arc::default()), FAILSAFE).await;
    let done = tokio::time::timeout(FAILSAFE, worker.run(ReadyOnSecondPoll::default()))
        .await
        .expect("run ends");
    assert_eq!(
        (done.received, done.released),
        (0, 0),
        "nothing received after the shutdown"
    );
    receivable_now(&q, 1, "the message was never delivered before").await;
}

/// Panics when dropped: what a handler's future holds when it is dropped
/// mid-way (a guard that checks, on drop, that its work was finished).
struct PanicsOnDrop;

impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        panic!("dropped before its work was done");
    }
}

/// Announces that it started, then waits for ever holding a
/// [`PanicsOnDrop`].
struct HoldsABomb(Arc<Gated>);

impl Handler for HoldsABomb {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        let _bomb = PanicsOnDrop;
        self.0.started.notify_one();
        std::future::pending::<()>().await;
        Ok(())
    }
}

/// A handler abandoned at the shutdown deadline whose future panics as
/// it is dropped was abandoned all the same: its message is handed back
/// at once. (The panic escaped the worker's task, which died before the
/// hand-back: the message waited out its hour-long visibility timeout.)
#[tokio::test]
async fn a_handler_that_panics_as_it_is_abandoned_has_its_message_handed_back() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let gated = Arc::new(Gated::default());
    let (q, _sent, worker) = one_message(&pool, HoldsABomb(gated.clone()), Duration::ZERO).await;
    let done = tokio::time::timeout(FAILSAFE, worker.run(gated.started.notified()))
        .await
        .expect("run ends at the deadline");
    assert_eq!(
        (done.abandoned, done.released),
        (1, 1),
        "the handler was abandoned and its message handed back"
    );
    receivable_now(
        &q,
        2,
        "the abandoned handler's message is handed back at once",
    )
    .await;
}

/// A message delivered late in a long poll gets its whole visibility
/// from the statement that delivered it, and the worker counts it from
/// there: its heartbeat beats, and nobody else gets the message while its
/// handler runs past the visibility. (The worker counted the delivery
/// from before the receive, its wait included: delivered 4.5 s into the
/// receive, with a 6 s visibility, it looked run out at its first beat,
/// 2 s later; the heartbeat stopped before beating, and the message was
/// delivered again at the end of its visibility, its handler still
/// running.)
///
/// Step by step: the worker's long poll (wait 5 s) parks, hearing of no
/// send (no listener), and looks again only at its poll 4.5 s in; once it
/// is seen parked, the message is sent, so its delivery is the look at
/// the poll. The handler is held while another consumer long-polls for
/// 8 s, past the delivery's own end.
#[tokio::test]
async fn a_delivery_late_in_a_long_poll_is_kept_by_its_heartbeat() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let visibility = Duration::from_secs(6);
    let deaf = PgQueueOptions {
        listen: pgonce::Listen::Off,
        poll_interval: Duration::from_millis(4500),
        ..PgQueueOptions::default()
    };
    let attributes = QueueAttributes::default().visibility_timeout(visibility);
    let q = PgQueue::create(&pool, "q", attributes, deaf).await.unwrap();
    let other = PgQueue::open(&pool, "q", PgQueueOptions::default())
        .await
        .unwrap();
    let gated = Arc::new(Gated::default());
    let config = WorkerConfig {
        concurrency: 1,
        batch: 1,
        wait: Duration::from_secs(5),
        visibility: None,
        heartbeat_interval: Some(Duration::from_secs(2)),
        heartbeat_extension: visibility,
        ..WorkerConfig::default()
    };
    let worker = Worker::new(q.clone(), Gate(gated.clone()), config).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let mut seen = None;
    let done = run_beside(&worker, stopped, async {
        while q.parked_receivers() == 0 {
            tokio::task::yield_now().await;
        }
        q.send(SendMessage::new("m")).await.unwrap();
        tokio::time::timeout(FAILSAFE, gated.started.notified())
            .await
            .expect("the handler started");
        let taken = other
            .receive(ReceiveRequest::up_to(1).wait(Duration::from_secs(8)))
            .await
            .unwrap();
        seen = Some((worker.counters(), taken));
        gated.go.notify_one();
        tokio::time::timeout(FAILSAFE, gated.finished.notified())
            .await
            .expect("the handler finished");
        stop.send(()).unwrap();
    })
    .await;
    let (beating, taken) = seen.expect("driven to the end");
    assert!(
        beating.heartbeats >= 1 && beating.expired == 0 && taken.is_empty(),
        "while the handler ran: its heartbeat beat ({} beats, {} expired), and no other \
         consumer got the message (got deliveries {:?})",
        beating.heartbeats,
        beating.expired,
        taken.iter().map(|m| m.receive_count).collect::<Vec<_>>()
    );
    assert_eq!(
        (done.succeeded, done.deleted, done.stale),
        (1, 1, 0),
        "acked as its only delivery: {done:?}"
    );
}

/// Claims its job on a connection of its own, which then dies (its
/// backend terminated, as a server restart or a network cut ends it)
/// before the work's outcome is written: the completion's error is the
/// handler's.
struct LosesItsConnectionAfterTheClaim {
    pool: PgPool,
    job_id: i64,
}

impl Handler for LosesItsConnectionAfterTheClaim {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        let mut conn = self.pool.acquire().await?;
        let lease = pgonce::job::claim(&mut *conn, self.job_id, Duration::from_secs(60)).await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await?;
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 20000)")
            .bind(pid)
            .fetch_one(&self.pool)
            .await?;
        assert!(ended, "the claim's connection is gone");
        pgonce::job::complete(&mut *conn, &lease, &serde_json::json!("done")).await?;
        Ok(())
    }
}

/// A handler whose connection died after its claim committed recorded
/// neither the work's outcome nor its failure: the job is processing
/// under a lease nobody holds, and its message is what claims it once the
/// lease has run out (a claim takes an expired lease over). Under
/// `AlwaysDelete` the worker deleted that message all the same, as for an
/// error the handler recorded: the lease ran out, the reaper made the job
/// pending, and nothing was left to drive it (the re-driver drives failed
/// jobs only). The message is kept now, as for a process that died.
#[tokio::test]
async fn a_connection_lost_after_the_claim_keeps_the_message_under_always_delete() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (q, job_id) = a_job_and_its_message(&pool).await;
    let handler = LosesItsConnectionAfterTheClaim {
        pool: pool.clone(),
        job_id,
    };
    kept_then_completed(&pool, &q, job_id, handler, JobStatus::Processing, 1).await;
}

/// Runs `handler` once on the job's message under `AlwaysDelete`: it fails,
/// the message is kept, and the job is `left`. Then the job's lease (if it
/// is processing) runs out, and the message's next delivery claims the job
/// (taking the lease over) and completes it: `attempts` counted (the lease
/// that ran out or was reaped; none for a claim that rolled back), no
/// message left.
async fn kept_then_completed(
    pool: &PgPool,
    q: &PgQueue,
    job_id: i64,
    handler: impl Handler,
    left: JobStatus,
    attempts: i32,
) {
    let worker = Worker::new(q.clone(), handler, always_delete_failures_back_at_once()).unwrap();
    let done = worker.run_once().await.unwrap();
    assert_eq!((done.failed, done.deleted), (1, 0), "the message is kept");
    let job = pgonce::job::get(pool, job_id).await.unwrap().unwrap();
    assert_eq!(job.status().unwrap(), left);
    completed_by_the_kept_message(pool, q, pool, job_id, attempts).await;
}

/// The second half of [`kept_then_completed`], for a job in `jobs` whose
/// message is kept in `q` (on `queue_pool`): the job's lease (if it is
/// processing) runs out, and the message's next delivery claims the job
/// and completes it: `attempts` counted, no message left.
async fn completed_by_the_kept_message(
    jobs: &PgPool,
    q: &PgQueue,
    queue_pool: &PgPool,
    job_id: i64,
    attempts: i32,
) {
    support::expire_lease(jobs, job_id).await;
    let completes = ClaimsAndCompletes {
        pool: jobs.clone(),
        job_id,
    };
    let worker = Worker::new(q.clone(), completes, always_delete_failures_back_at_once()).unwrap();
    let done = worker.run_once().await.unwrap();
    assert_eq!((done.succeeded, done.deleted), (1, 1));
    let job = pgonce::job::get(jobs, job_id).await.unwrap().unwrap();
    assert_eq!(
        (job.status().unwrap(), job.attempts),
        (JobStatus::Completed, attempts)
    );
    assert_eq!(messages(queue_pool).await, 0);
}

/// Claims its job and completes it.
struct ClaimsAndCompletes {
    pool: PgPool,
    job_id: i64,
}

impl Handler for ClaimsAndCompletes {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        let lease = pgonce::job::claim(&self.pool, self.job_id, Duration::from_secs(60)).await?;
        pgonce::job::complete(&self.pool, &lease, &serde_json::json!("done")).await?;
        Ok(())
    }
}

/// Claims its job; while it works, its lease runs out and the reaper
/// makes the job pending (the handler plays the time passing and the
/// reaper's pass itself); then its completion hears the lease lost.
struct OutlivesItsLease {
    pool: PgPool,
    job_id: i64,
}

impl Handler for OutlivesItsLease {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        let lease = pgonce::job::claim(&self.pool, self.job_id, Duration::from_secs(60)).await?;
        sqlx::query(
            "UPDATE pgonce.jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
        )
        .bind(self.job_id)
        .execute(&self.pool)
        .await?;
        let reaper = pgonce::job::Reaper::new(self.pool.clone(), Default::default())?;
        assert_eq!(reaper.run_once().await?.returned, 1);
        pgonce::job::complete(&self.pool, &lease, &serde_json::json!("late")).await?;
        Ok(())
    }
}

/// A lease lost to the reaper, not to another delivery, leaves the job
/// pending with nobody holding it: the lost completion wrote nothing, and
/// the handler's message is all that drives the job. Under `AlwaysDelete`
/// the worker deleted it, as for a failure the row holds, and the job sat
/// pending with no message (the re-driver drives failed jobs only). The
/// message is kept now; its next delivery claims the job and completes
/// it.
#[tokio::test]
async fn a_lease_lost_to_the_reaper_keeps_the_message_under_always_delete() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (q, job_id) = a_job_and_its_message(&pool).await;
    let handler = OutlivesItsLease {
        pool: pool.clone(),
        job_id,
    };
    kept_then_completed(&pool, &q, job_id, handler, JobStatus::Pending, 1).await;
}

/// Claims its job in its work's transaction, then idles in it past the
/// session's `idle_in_transaction_session_timeout` (set to a millisecond
/// for this transaction): PostgreSQL ends the session (FATAL, SQLSTATE
/// 25P03), and the claim rolls back with it. The completion's error, once
/// the handler has seen its session gone, is the handler's.
struct IdlesPastItsTransactionTimeout {
    pool: PgPool,
    job_id: i64,
}

impl Handler for IdlesPastItsTransactionTimeout {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        let mut tx = pgonce::begin(&self.pool, pgonce::IsolationLevel::ReadCommitted).await?;
        let lease = pgonce::job::claim(&mut *tx, self.job_id, Duration::from_secs(60)).await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await?;
        sqlx::query("SET LOCAL idle_in_transaction_session_timeout = '1ms'")
            .execute(&mut *tx)
            .await?;
        session_ended(&self.pool, pid).await;
        pgonce::job::complete(&mut *tx, &lease, &serde_json::json!("done")).await?;
        tx.commit().await?;
        Ok(())
    }
}

/// Waits until the session of backend `pid` is gone from
/// `pg_stat_activity`.
async fn session_ended(pool: &PgPool, pid: i32) {
    tokio::time::timeout(FAILSAFE, async {
        loop {
            let alive: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)")
                    .bind(pid)
                    .fetch_one(pool)
                    .await
                    .unwrap();
            if !alive {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the server ends the idle transaction's session");
}

/// A session PostgreSQL ended for idling in a transaction past
/// `idle_in_transaction_session_timeout` rolled its transaction back,
/// the job's claim with it: the job is pending, held by nobody, and its
/// message is all that drives it. The server says so with a FATAL error
/// of its own SQLSTATE (25P03), not a connection exception; under
/// `AlwaysDelete` the worker took it for a failure the row holds and
/// deleted the message, and the job sat pending with nothing to run it.
#[tokio::test]
async fn a_session_ended_for_idling_in_its_transaction_keeps_the_message_under_always_delete() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (q, job_id) = a_job_and_its_message(&pool).await;
    let handler = IdlesPastItsTransactionTimeout {
        pool: pool.clone(),
        job_id,
    };
    kept_then_completed(&pool, &q, job_id, handler, JobStatus::Pending, 0).await;
}

/// Claims its job through PgBouncer; then PostgreSQL stops taking logins
/// to the job's database (as while it restarts) and PgBouncer's server
/// connections are cut (the handler plays the outage itself), so the
/// completion, through PgBouncer again, finds no server to run on: the
/// pooler's own error, `Error::Pooler` (`ServerUnreachable`).
struct LosesItsServerBehindThePooler {
    pooled: PgPool,
    admin: PgPool,
    database: String,
    job_id: i64,
    /// What the completion returned.
    completion: std::sync::Mutex<Option<String>>,
}

impl Handler for LosesItsServerBehindThePooler {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        let lease = pgonce::job::claim(&self.pooled, self.job_id, Duration::from_secs(60)).await?;
        logins_to(&self.admin, &self.database, false).await;
        sqlx::query(
            "SELECT pg_terminate_backend(pid, 20000) FROM pg_stat_activity WHERE datname = $1",
        )
        .bind(&self.database)
        .execute(&self.admin)
        .await?;
        let out = pgonce::job::complete(&self.pooled, &lease, &serde_json::json!("done")).await;
        *self.completion.lock().unwrap() = Some(format!("{out:?}"));
        out?;
        Ok(())
    }
}

/// Lets (`true`) or stops (`false`) logins to `database`, from `admin`, a
/// connection to another database.
async fn logins_to(admin: &PgPool, database: &str, allowed: bool) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{database}\" ALLOW_CONNECTIONS {allowed}"
    )))
    .execute(admin)
    .await
    .unwrap();
}

/// Behind PgBouncer, a server that went away after the claim committed
/// (restarting, refusing logins) is not an I/O error or a class 08
/// SQLSTATE of the server's: PgBouncer answers with its own text, which
/// pgonce reports as `Error::Pooler`. The handler recorded nothing, as
/// with a lost connection; under `AlwaysDelete` the worker deleted its
/// message all the same (the queue lives elsewhere, as SQS does), and the
/// job, reaped to pending once its lease ran out, had nothing to drive it.
/// The message is kept now; once the server is back its next delivery
/// takes the expired lease over and completes the job.
#[tokio::test]
async fn a_server_lost_behind_the_pooler_keeps_the_message_under_always_delete() {
    let (jobs_db, pooled) =
        pgonce_testkit::fresh_migrated_database_behind_pooler(2, pgonce::migrate).await;
    let (_queue_db, queue_pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let q = queue(&queue_pool, "q").await;
    q.send(SendMessage::new("job")).await.unwrap();
    let job_id = pgonce::job::enqueue(
        &pooled,
        &pgonce::job::NewJob::new("send", serde_json::json!({})),
    )
    .await
    .unwrap();
    let admin = PgPool::connect_with(
        pgonce_testkit::shared_for_tests()
            .unwrap()
            .options()
            .clone(),
    )
    .await
    .unwrap();
    let handler = LosesItsServerBehindThePooler {
        pooled,
        admin: admin.clone(),
        database: jobs_db.name().to_owned(),
        job_id,
        completion: Default::default(),
    };
    let worker = Worker::new(q.clone(), handler, always_delete_failures_back_at_once()).unwrap();
    let done = worker.run_once().await.unwrap();
    logins_to(&admin, jobs_db.name(), true).await;
    let completion = worker.handler().completion.lock().unwrap().take().unwrap();
    assert!(
        completion.starts_with("Err(Pooler { problem: ServerUnreachable"),
        "{completion}"
    );
    assert_eq!((done.failed, done.deleted), (1, 0), "the message is kept");

    // The server back (over a direct connection: PgBouncer caches the
    // failed login a while), the lease runs out; the message takes it over.
    let direct = jobs_db.pool(2).await.unwrap();
    completed_by_the_kept_message(&direct, &q, &queue_pool, job_id, 1).await;
}

/// Claims its job, then the job it depends on, which another delivery
/// holds: `JobBusy`. Its own job's attempt fails for it, which the
/// handler records with `fail` and returns as a `FailureRecorded` caused
/// by the `JobBusy`.
struct WaitsOnABusyDependency {
    pool: PgPool,
    job_id: i64,
    dependency: i64,
}

impl Handler for WaitsOnABusyDependency {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        let lease = pgonce::job::claim(&self.pool, self.job_id, Duration::from_secs(60)).await?;
        let cause = pgonce::job::claim(&self.pool, self.dependency, Duration::from_secs(60))
            .await
            .expect_err("the dependency is held by another delivery");
        Err(failure_recorded(&self.pool, &lease, cause).await?)
    }
}

/// A recorded failure deletes its message under `AlwaysDelete` whatever
/// caused it: the row drives the retry. One caused by a `JobBusy` (of
/// another job, which the work waited on) had its message kept all the
/// same, hidden until that other job's lease ran out, as a busy claim of
/// its own would: the worker looked for a `JobBusy` in the error's causes
/// before it looked for the recorded failure. The retry then had two
/// messages, the kept one and the re-driver's.
#[tokio::test]
async fn a_recorded_failure_caused_by_a_busy_job_deletes_its_message_under_always_delete() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let (q, job_id) = a_job_and_its_message(&pool).await;
    let dependency = pgonce::job::enqueue(
        &pool,
        &pgonce::job::NewJob::new("send", serde_json::json!({})),
    )
    .await
    .unwrap();
    pgonce::job::claim(&pool, dependency, Duration::from_secs(3600))
        .await
        .unwrap();
    let handler = WaitsOnABusyDependency {
        pool: pool.clone(),
        job_id,
        dependency,
    };
    let worker = Worker::new(q.clone(), handler, always_delete_failures_back_at_once()).unwrap();
    let done = worker.run_once().await.unwrap();
    let job = pgonce::job::get(&pool, job_id).await.unwrap().unwrap();
    assert_eq!(
        (job.status().unwrap(), job.attempts),
        (JobStatus::Failed, 1),
        "the failure is recorded"
    );
    assert_eq!(
        (done.failed, done.deleted),
        (1, 1),
        "the recorded failure's message is deleted"
    );
    assert_eq!(messages(&pool).await, 0);
}

/// Succeeds on every delivery.
struct Succeeds;

impl Handler for Succeeds {
    async fn handle(&self, _m: &Received) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// Polls `worker`'s counters until `done` holds of them.
async fn until_counted<Q: Queue + 'static, H: Handler>(
    worker: &Worker<Q, H>,
    done: impl Fn(&pgonce::WorkerCounters) -> bool,
    what: &str,
) -> pgonce::WorkerCounters {
    tokio::time::timeout(FAILSAFE, async {
        loop {
            let counters = worker.counters();
            if done(&counters) {
                return counters;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect(what)
}

/// A worker whose queue was deleted by hand keeps retrying its receives,
/// and counts each failure, in its counters and in
/// `pgonce_queue_worker_failed_receives_total`; once the queue is created
/// again, the next receive delivers what was sent to it, and failures stop
/// being counted: a second message, handled, finds the count unchanged.
/// The log has the first failure at warn with its error, the others at
/// debug but for at most one warn line per minute of the run (none, unless
/// the machine held the test up for a minute: the bound is read from the
/// test's own clock, so a slow run is not a failure), and one info line at
/// the recovery with the count. (Failed receives were logged at warn, a line per
/// second, and counted nowhere.)
#[tokio::test]
async fn a_worker_counts_failed_receives_of_a_deleted_queue_and_recovers() {
    let (_db, pool) = fresh_migrated_database(5, pgonce::migrate).await;
    let q = queue(&pool, "q").await;
    let failing_from = std::time::Instant::now();
    sqlx::query("DELETE FROM pgonce.queue WHERE name = 'q'")
        .execute(&pool)
        .await
        .unwrap();
    let (metric, recorder) = support::count_of("pgonce_queue_worker_failed_receives_total");
    // On this single-threaded runtime the worker's tasks record here too.
    let _local = metrics::set_default_local_recorder(&recorder);
    let logged = LogLines::default();
    let _logging = logged.capture();
    let config = hour_long(WorkerConfig {
        concurrency: 1,
        batch: 1,
        ..WorkerConfig::default()
    });
    let worker = Worker::new(q.clone(), Succeeds, config).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let mut seen = None;
    let mut failing_for = Duration::ZERO;
    let done = run_beside(&worker, stopped, async {
        until_counted(&worker, |c| c.failed_receives >= 2, "two receives failed").await;
        let again = queue(&pool, "q").await;
        again.send(SendMessage::new("a")).await.unwrap();
        let recovered = until_counted(&worker, |c| c.succeeded == 1, "recovered").await;
        failing_for = failing_from.elapsed();
        again.send(SendMessage::new("b")).await.unwrap();
        let later = until_counted(&worker, |c| c.succeeded == 2, "handled b").await;
        seen = Some((recovered, later));
        let _ = stop.send(());
    })
    .await;
    let (recovered, later) = seen.expect("driven to the end");
    assert!(
        recovered.failed_receives >= 2,
        "the failures were counted: {recovered:?}"
    );
    assert_eq!(
        later.failed_receives, recovered.failed_receives,
        "no receive failed once the queue was back: {later:?}"
    );
    assert_eq!(
        (done.failed_receives, done.succeeded, done.deleted),
        (recovered.failed_receives, 2, 2),
        "the run's own counters: {done:?}"
    );
    assert_eq!(
        metric.load(std::sync::atomic::Ordering::SeqCst),
        recovered.failed_receives,
        "the metric counts what the counters do"
    );
    let failed = recovered.failed_receives;
    let first = logged.assert_run_of_failures(
        failed,
        failing_for,
        "receive failed",
        "receives still failing",
        Some(&format!(
            "receive recovered after {failed} failed receives since "
        )),
    );
    assert_eq!(
        first.error.as_deref(),
        Some(r#"queue "q" does not exist"#),
        "with its error"
    );
}

/// Sends each message's body to the test as it is handled.
struct Reporting(tokio::sync::mpsc::UnboundedSender<String>);

impl Handler for Reporting {
    async fn handle(&self, m: &Received) -> Result<(), HandlerError> {
        let _ = self.0.send(m.body.clone());
        Ok(())
    }
}

/// A worker long-polling (LISTEN on its pool) when the server restarts,
/// on a cluster of the test's own, takes up its work by itself: a message
/// sent after the restart is handled and deleted.
#[tokio::test]
async fn a_worker_idle_when_the_server_restarts_takes_up_its_work_again() {
    let mut cluster = tokio::task::spawn_blocking(pgonce_testkit::Cluster::start)
        .await
        .unwrap()
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&cluster.url("postgres"))
        .await
        .unwrap();
    pgonce::migrate(&pool).await.unwrap();
    let q = queue(&pool, "restarted").await;
    let (handled, mut bodies) = tokio::sync::mpsc::unbounded_channel();
    let worker = Arc::new(
        Worker::new(
            q.clone(),
            Reporting(handled),
            WorkerConfig {
                concurrency: 1,
                wait: Duration::from_secs(5),
                ..WorkerConfig::default()
            },
        )
        .unwrap(),
    );
    let stop = Arc::new(Notify::new());
    let running = tokio::spawn({
        let (worker, stop) = (worker.clone(), stop.clone());
        async move { worker.run(stop.notified()).await }
    });
    q.send(SendMessage::new("before")).await.unwrap();
    let first = tokio::time::timeout(FAILSAFE, bodies.recv()).await.unwrap();
    assert_eq!(first.as_deref(), Some("before"));
    // Its delete done too, before the restart could cut it.
    tokio::time::timeout(FAILSAFE, async {
        while worker.counters().deleted < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();

    cluster = tokio::task::spawn_blocking(move || {
        cluster
            .restart(pgonce_testkit::ShutdownMode::Immediate)
            .unwrap();
        cluster
    })
    .await
    .unwrap();
    q.send(SendMessage::new("after")).await.unwrap();
    let second = tokio::time::timeout(FAILSAFE, bodies.recv()).await;
    let counters = worker.counters();
    assert_eq!(
        second.ok().flatten().as_deref(),
        Some("after"),
        "{counters:?}"
    );
    stop.notify_one();
    let done = tokio::time::timeout(FAILSAFE, running)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((done.received, done.deleted), (2, 2), "{done:?}");
    let stats = q.stats().await.unwrap();
    assert_eq!((stats.depth, stats.in_flight), (0, 0), "{stats:?}");
    drop(cluster);
}

/// A worker whose receives do not wait is refused, named: on an empty
/// queue its loop received again at once, without end (about a thousand
/// statements a second from one idle worker).
#[tokio::test]
async fn a_worker_whose_receives_do_not_wait_is_refused() {
    let (_db, pool) = fresh_migrated_database(2, pgonce::migrate).await;
    let q = queue(&pool, "never-waits").await;
    let (handled, _bodies) = tokio::sync::mpsc::unbounded_channel();
    let config = WorkerConfig {
        wait: Duration::ZERO,
        ..WorkerConfig::default()
    };
    match Worker::new(q, Reporting(handled), config) {
        Err(pgonce::Error::Invalid { what, why }) => {
            assert_eq!(what, "worker config wait");
            assert!(why.contains("above zero"), "{why}");
        }
        Err(other) => panic!("another error: {other}"),
        Ok(_) => panic!("a worker receiving without waiting was accepted"),
    }
}
