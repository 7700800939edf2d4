//! The worker runtime on the PostgreSQL queue, where its promises meet the
//! database: a handler keeps running while its heartbeat waits on the
//! database, and a handler that panics is a failure like any other.

use std::sync::Arc;
use std::time::Duration;

use pgonce::{
    Handler, HandlerError, PgQueue, PgQueueOptions, Queue, QueueAttributes, ReceiveRequest,
    Received, SendMessage, Worker, WorkerConfig,
};
use pgonce_testkit::fresh_migrated_database;
use sqlx::PgPool;
use tokio::sync::Notify;

/// Generous: only reached when what a test waits for never happens.
const FAILSAFE: Duration = Duration::from_secs(20);

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
    tokio::time::timeout(FAILSAFE, async {
        while blocked_by(pool, holder_pid).await == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("a heartbeat waits on the row lock");
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
    let again = q.receive(ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(
        again.iter().map(|m| m.receive_count).collect::<Vec<_>>(),
        [2],
        "the message of a panicked handler is receivable again at once"
    );
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
