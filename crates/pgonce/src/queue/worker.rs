//! The worker runtime: receives from any [`Queue`], runs a [`Handler`] per
//! message under a concurrency limit, keeps the message invisible while
//! the handler runs (heartbeat), acks by policy, and shuts down gracefully.
//!
//! The worker holds no database connection while a handler runs: it
//! receives (one short statement), hands the message over, and uses a
//! connection again only for each heartbeat and for the ack.
//!
//! # Shutdown
//!
//! What [`Worker::run`] does once its `shutdown` resolves, so that no
//! message waits out a visibility timeout because of it:
//!
//! * No receive starts. A receive under way is told to stop
//!   ([`Queue::receive_or_stop`]), not dropped: one waiting for messages
//!   gives up at once, with nothing delivered; one whose statement is
//!   running finishes, and every message it delivered is handed back
//!   unhandled, visible again at once. (Dropped, its deliveries went to
//!   nobody and waited out their visibility timeout.)
//! * Handlers running get `shutdown_deadline` to finish; one that
//!   finishes is acked as at any other time, a heartbeat in flight first.
//! * At the deadline, a handler still running is abandoned: its future is
//!   dropped (the work it did so far stays done, as when a process dies,
//!   which a redelivery has to tolerate anyway), a heartbeat in flight is
//!   finished (dropped, it could land after the hand-back and hide the
//!   message again), and its message is handed back, visible again at
//!   once. Unless its delivery ran out meanwhile, by the worker's clock
//!   (the visibility its delivery got, [`Received::visibility`], or the
//!   last beat's extension; a beat refused as stale): the message is
//!   visible again already, or another worker's, whose delivery a
//!   hand-back on a backend that does not fence receipts (SQS) would make
//!   visible. A handler that finished but was not acked yet is acked, not
//!   abandoned.
//! * Acks and hand-backs still under way at the deadline get 5 s more,
//!   as does a receive still running; whatever is
//!   left then is dropped, and its message comes back after its
//!   visibility timeout, as does one whose hand-back failed.
//!
//! The gauge `pgonce_queue_worker_in_flight` counts handlers running: one
//! abandoned, or dropped with its task, is off it all the same, so once
//! `run` returns it reads what the worker left running, nothing.
//!
//! # Failed receives
//!
//! A receive that fails (the database down or refusing logins, the queue
//! deleted by hand: [`Error::QueueNotFound`], a role without the rights) is
//! retried by [`Worker::run`] after a second, for as long as it fails, so
//! that the worker takes up its work right after the database comes back.
//! Each one counts in [`WorkerCounters::failed_receives`] and in the
//! counter `pgonce_queue_worker_failed_receives_total{queue}`. The log
//! says what an operator needs without a line per second: the first
//! failure of a run of them at warn, with its error; while they go on, at
//! most one warn line a minute, with how many failed since when and the
//! latest error (each failure in between at debug); and, once a receive
//! succeeds again, one info line saying after how many failures.
//! [`Worker::run_once`] returns its receive's error to the caller, counted
//! all the same.
//!
//! # Metrics
//!
//! Each labelled with the `queue`: the counters
//! `pgonce_queue_worker_received_total`,
//! `pgonce_queue_worker_redelivered_total`,
//! `pgonce_queue_worker_failed_total` (handlers that failed, a busy job's
//! aside), `pgonce_queue_worker_deleted_total` and
//! `pgonce_queue_worker_failed_receives_total`; the gauge
//! `pgonce_queue_worker_in_flight`; the histogram
//! `pgonce_queue_worker_handler_seconds` (each handler that ended, not
//! abandoned).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinSet;

use super::{Queue, ReceiveRequest, Received};
use crate::error::{Error, Result};
use crate::service::{Failure, Failures};

/// What a handler returns when it could not process a message.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// Processes one message. Must be idempotent or guarded by one of pgonce's
/// safeguards: the same message can arrive twice, or concurrently.
pub trait Handler: Send + Sync + 'static {
    /// Handles `message`. `Ok` acks it; `Err` leaves it for redelivery (or,
    /// under [`AckPolicy::AlwaysDelete`], deletes it anyway). An `Err` that
    /// is a [`Error::JobBusy`], or is caused by one (found through
    /// [`std::error::Error::source`]; a wrapper whose `source` skips it, as
    /// `#[error(transparent)]` does, hides it), is never deleted: the
    /// message becomes visible again at the job's `not_before`. One that
    /// is, or is caused by, a [`crate::job::FailureRecorded`] is deleted
    /// under [`AckPolicy::AlwaysDelete`] whatever else it holds, a
    /// `JobBusy` among its causes included (another job's, which the work
    /// waited on: this job's retry is the row's). A panic is
    /// a failure that is never deleted either: the worker catches it,
    /// counts it in [`WorkerCounters::failed`], and keeps the message as a
    /// dead process would (visible again after `failure_visibility`, if
    /// set).
    ///
    /// The worker owns the handler's future: dropping it (a handler
    /// abandoned at the shutdown deadline) stops the work. Work the handler
    /// hands to a task of its own (`tokio::spawn`) is not stopped with it
    /// and may go on while the message, handed back, is delivered again:
    /// await such work inside `handle`, or make it safe to run twice.
    fn handle(
        &self,
        message: &Received,
    ) -> impl Future<Output = std::result::Result<(), HandlerError>> + Send;
}

/// When the worker deletes a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AckPolicy {
    /// Delete on success; on failure leave it in the queue, to be received
    /// again after `failure_visibility` (or the visibility timeout) and
    /// dead-lettered after the queue's max receive count.
    #[default]
    DeleteOnSuccess,
    /// Delete whatever the outcome: the handler records failures in the
    /// database (a job row with an attempt count, see the job pattern),
    /// which is then the retry ledger; the queue only carries the nudge.
    /// A handler that panicked recorded nothing, so its message is kept
    /// (visible again after `failure_visibility`, if set); so is one whose
    /// error is, or is caused by, a retryable [`Error`] (a serialization
    /// failure or deadlock, whose transaction PostgreSQL rolled back, or a
    /// send that sent nothing: [`Error::is_retryable`]), an
    /// [`Error::LockNotAvailable`] (a row wait, such as a job's claim,
    /// given up past the session's `lock_timeout`, nothing written) or an
    /// [`Error::QueryCanceled`] (a statement cut by `statement_timeout`,
    /// or canceled, its work undone), or an [`Error::Database`] that says
    /// the connection was lost (the socket or TLS failed, the server ended
    /// the session, the pool gave none) or an [`Error::Pooler`] (a pooler
    /// that could not run the statement, PgBouncer finding no server among
    /// them): the handler could record nothing more, as if its process had
    /// died; or an [`Error::LeaseLost`] (the
    /// write under the lost lease wrote nothing, and a lease lost to the
    /// reaper leaves the job pending with nobody holding it: the message's
    /// next delivery claims it). A handler that did record its job's
    /// failed attempt ([`crate::job::fail`] committed) says so by returning
    /// a [`crate::job::FailureRecorded`] (or an error caused by one): its
    /// message is deleted whatever caused the failure, since the
    /// [`crate::job::Redriver`] drives the retry (a kept message would
    /// deliver the job a second time).
    AlwaysDelete,
}

impl AckPolicy {
    /// For consumers written by hand: whether to delete the message after
    /// processing ended with `outcome`. [`Error::AlreadyHandled`] counts as
    /// success (another delivery did the work). [`Error::JobBusy`] keeps the
    /// message under either policy: the job is not done and is in another
    /// delivery's hands, and if that delivery dies this message is what
    /// drives the reaped job. A retryable error ([`Error::is_retryable`]: a
    /// transaction PostgreSQL aborted, a send that sent nothing), an
    /// [`Error::LockNotAvailable`] (a wait for a row given up, nothing
    /// written) and an [`Error::QueryCanceled`] (a statement cut by
    /// `statement_timeout`, its work undone) keep it too: nothing of the
    /// attempt was recorded. So do an [`Error::Database`] that says the
    /// connection was lost (nothing more could be recorded on it), an
    /// [`Error::Pooler`] (the pooler in front of PostgreSQL could not run
    /// the statement: the same, until it can) and an
    /// [`Error::LeaseLost`] (the write under it wrote nothing, and the job
    /// may be pending with nobody holding it: reaped, not taken over). Once [`crate::job::fail`] has recorded the
    /// attempt's failure, pass its outcome (`Ok`), not the error that
    /// caused it: under `AlwaysDelete` the row drives the retry, and a kept
    /// message would deliver the job a second time. A process that died
    /// never gets here, so never deletes, and the message comes back.
    pub fn delete_message<T>(self, outcome: &crate::Result<T>) -> bool {
        match (self, outcome) {
            (_, Err(crate::Error::JobBusy { .. })) => false,
            (_, Err(e)) if recorded_nothing(e) => false,
            (AckPolicy::AlwaysDelete, _) => true,
            (AckPolicy::DeleteOnSuccess, Ok(_)) => true,
            (AckPolicy::DeleteOnSuccess, Err(crate::Error::AlreadyHandled { .. })) => true,
            (AckPolicy::DeleteOnSuccess, Err(_)) => false,
        }
    }
}

/// The worker's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Handlers running at once, at most. Default 8; at least 1.
    pub concurrency: usize,
    /// Messages asked for per receive, at most (also capped by free
    /// handler slots). Default 10; at least 1.
    pub batch: usize,
    /// Long-poll wait of each receive. Default 5 s; above zero. An empty
    /// receive is followed by the next at once, so this is how often an
    /// idle worker receives.
    pub wait: Duration,
    /// Visibility timeout of each delivery; `None`: the queue's. Default
    /// `None`.
    pub visibility: Option<Duration>,
    /// While a handler runs, extend the message's visibility this often.
    /// `None`: no heartbeat. Default 10 s; at least 1 ms, and shorter than
    /// the visibility timeout in use. With `visibility` `None` that is the
    /// queue's, which the worker learns only from a delivery
    /// ([`Received::visibility`]): it then warns, once, of an interval
    /// that is not shorter, and each such delivery's heartbeat stops
    /// before its first beat, the delivery having run out
    /// ([`WorkerCounters::expired`]). The worker counts a delivery from
    /// when the backend sent the statement or request that delivered it
    /// ([`Received::requested_at`]): on the PostgreSQL queue, a long
    /// poll's wait is not counted. On SQS, whose request waits (up to
    /// 20 s) and then delivers, it is: there keep the interval shorter
    /// than the visibility less `wait` (20 s at most), or a delivery made
    /// late in a long poll may look run out at its first beat.
    pub heartbeat_interval: Option<Duration>,
    /// Each heartbeat makes the message invisible for this long from now.
    /// Default 30 s; longer than `heartbeat_interval` (or the message would
    /// turn visible between two beats), at most 12 h (SQS's limit).
    pub heartbeat_extension: Duration,
    /// When to delete. Default [`AckPolicy::DeleteOnSuccess`].
    pub ack: AckPolicy,
    /// After a failed handler (with `DeleteOnSuccess`; after a panic, under
    /// either policy), make the message visible again after this long
    /// instead of waiting out its visibility timeout. Default `None` (wait
    /// it out).
    pub failure_visibility: Option<Duration>,
    /// `run` waits this long for in-flight handlers after shutdown; those
    /// still running are abandoned and their messages handed back, visible
    /// again at once (module docs, Shutdown). Acks, hand-backs and a
    /// receive still running then get 5 s more, so `run` returns within
    /// `shutdown_deadline` plus 5 s: give whatever stops the process (a
    /// service manager's stop timeout, a container's grace period) more
    /// than that, or it kills the process before the hand-backs. On a
    /// backend that cannot stop a long poll ([`Queue::receive_or_stop`]'s
    /// default, SQS), a receive under way at the shutdown finishes its
    /// `wait`: with `wait` longer than `shutdown_deadline` plus 5 s it can
    /// be dropped still waiting, and what it then delivers waits out its
    /// visibility timeout. `Duration::MAX` waits for the handlers however
    /// long they take. Default 30 s.
    pub shutdown_deadline: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: 8,
            batch: 10,
            wait: Duration::from_secs(5),
            visibility: None,
            heartbeat_interval: Some(Duration::from_secs(10)),
            heartbeat_extension: Duration::from_secs(30),
            ack: AckPolicy::DeleteOnSuccess,
            failure_visibility: None,
            shutdown_deadline: Duration::from_secs(30),
        }
    }
}

impl WorkerConfig {
    /// Checks the invariants stated on each field.
    pub fn validate(&self) -> Result<()> {
        let invalid = |why: &str| {
            Err(Error::Invalid {
                what: "worker config",
                why: why.into(),
            })
        };
        if self.concurrency == 0 || self.batch == 0 {
            return invalid("concurrency and batch are at least 1");
        }
        // An empty receive is followed by the next at once: without a
        // wait, a worker on an empty queue sent receives in a loop, about a
        // thousand statements a second. The wait is what paces it.
        if self.wait.is_zero() {
            return Err(Error::Invalid {
                what: "worker config wait",
                why: "must be above zero: an empty receive is followed by the next at once, so a worker that does not wait receives in a loop while the queue is empty".into(),
            });
        }
        // The handler slots are a semaphore's permits.
        if self.concurrency > Semaphore::MAX_PERMITS {
            return invalid("concurrency is at most tokio's Semaphore::MAX_PERMITS");
        }
        // Each receive asks for up to `batch` messages with this wait and
        // visibility: a request no backend takes would fail every receive,
        // and the worker would retry it for ever.
        let mut largest = ReceiveRequest::up_to(self.batch).wait(self.wait);
        largest.visibility = self.visibility;
        largest.validate().map_err(|e| match e {
            Error::Invalid { why, .. } => Error::Invalid {
                what: "worker config",
                why: format!("batch, wait and visibility make receives no backend takes: {why}"),
            },
            other => other,
        })?;
        // Shorter than a millisecond, the heartbeat is a busy loop of
        // statements; past the longest visibility, it never beats in time.
        if let Some(h) = self.heartbeat_interval {
            crate::duration::check_within(
                "worker config heartbeat_interval",
                h,
                Duration::from_millis(1),
                super::MAX_VISIBILITY,
            )?;
        }
        if let (Some(h), Some(v)) = (self.heartbeat_interval, self.visibility)
            && h >= v
        {
            return invalid("heartbeat_interval must be shorter than the visibility timeout");
        }
        if let Some(h) = self.heartbeat_interval
            && self.heartbeat_extension <= h
        {
            return invalid(
                "heartbeat_extension must be longer than heartbeat_interval: each beat must outlast the wait for the next",
            );
        }
        if self
            .failure_visibility
            .is_some_and(|v| v > super::MAX_VISIBILITY)
        {
            return invalid("failure_visibility must be at most 12 h");
        }
        if self.heartbeat_extension > super::MAX_VISIBILITY {
            return invalid("heartbeat_extension must be at most 12 h");
        }
        Ok(())
    }
}

/// What a worker did: one call ([`Worker::run_once`], a whole
/// [`Worker::run`]), or every call ([`Worker::counters`]). A call counts
/// only its own work: of two calls of one worker running at once, each
/// returns what it did, not what the other did meanwhile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerCounters {
    /// Messages received.
    pub received: u64,
    /// Of those, deliveries after the first (receive count > 1).
    pub redelivered: u64,
    /// Handlers that returned Ok.
    pub succeeded: u64,
    /// Handlers that returned Err or panicked.
    pub failed: u64,
    /// Messages deleted.
    pub deleted: u64,
    /// Acks or heartbeats refused as stale: another delivery owns the
    /// message now.
    pub stale: u64,
    /// Visibility extensions made while handlers ran.
    pub heartbeats: u64,
    /// Deliveries whose heartbeat stopped because the delivery had run
    /// out, by the worker's clock, while its handler ran (its beats failed,
    /// or came too late): a beat then could extend another worker's
    /// delivery of the message on a backend that does not fence receipts
    /// (SQS). The handler runs on; its message may be delivered again
    /// meanwhile.
    pub expired: u64,
    /// Handlers still running at the shutdown deadline, dropped.
    pub abandoned: u64,
    /// Messages handed back unhandled at shutdown, visible again at once:
    /// delivered by a receive that finished after the shutdown began, or
    /// held by an abandoned handler.
    pub released: u64,
    /// Receives that failed (module docs, Failed receives); no message is
    /// counted in the others for them.
    pub failed_receives: u64,
}

impl std::ops::AddAssign for WorkerCounters {
    /// Sums the counters of several workers.
    fn add_assign(&mut self, o: WorkerCounters) {
        self.received += o.received;
        self.redelivered += o.redelivered;
        self.succeeded += o.succeeded;
        self.failed += o.failed;
        self.deleted += o.deleted;
        self.stale += o.stale;
        self.heartbeats += o.heartbeats;
        self.expired += o.expired;
        self.abandoned += o.abandoned;
        self.released += o.released;
        self.failed_receives += o.failed_receives;
    }
}

#[derive(Default)]
struct Counters {
    received: AtomicU64,
    redelivered: AtomicU64,
    succeeded: AtomicU64,
    failed: AtomicU64,
    deleted: AtomicU64,
    stale: AtomicU64,
    heartbeats: AtomicU64,
    expired: AtomicU64,
    abandoned: AtomicU64,
    released: AtomicU64,
    failed_receives: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> WorkerCounters {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WorkerCounters {
            received: g(&self.received),
            redelivered: g(&self.redelivered),
            succeeded: g(&self.succeeded),
            failed: g(&self.failed),
            deleted: g(&self.deleted),
            stale: g(&self.stale),
            heartbeats: g(&self.heartbeats),
            expired: g(&self.expired),
            abandoned: g(&self.abandoned),
            released: g(&self.released),
            failed_receives: g(&self.failed_receives),
        }
    }
}

/// Consumes a queue with a handler. See the module docs.
pub struct Worker<Q, H> {
    shared: Arc<Shared<Q, H>>,
}

struct Shared<Q, H> {
    queue: Q,
    handler: H,
    config: WorkerConfig,
    /// What the worker did over all its calls; each call counts what it
    /// did in counters of its own as well, which it returns.
    counters: Counters,
    /// Whether a delivery was seen whose visibility (the queue's) the
    /// heartbeat interval is not shorter than: warned of once.
    beats_too_seldom: AtomicBool,
}

impl<Q: Queue + 'static, H: Handler> Worker<Q, H> {
    /// A worker for `queue` and `handler`; the config is validated.
    pub fn new(queue: Q, handler: H, config: WorkerConfig) -> Result<Worker<Q, H>> {
        config.validate()?;
        Ok(Worker {
            shared: Arc::new(Shared {
                queue,
                handler,
                config,
                counters: Counters::default(),
                beats_too_seldom: AtomicBool::new(false),
            }),
        })
    }

    /// The handler (for tests that inspect it).
    pub fn handler(&self) -> &H {
        &self.shared.handler
    }

    /// What this worker did so far, over all calls (those still running
    /// included).
    pub fn counters(&self) -> WorkerCounters {
        self.shared.counters.snapshot()
    }

    /// One receive (without waiting) of up to `concurrency.min(batch)`
    /// messages, all handled concurrently and acked; returns what this call
    /// did.
    pub async fn run_once(&self) -> Result<WorkerCounters> {
        // Counters of this call's own, not the difference of the worker's
        // over the call: another call running meanwhile counts there too.
        let call = Arc::new(Counters::default());
        let max = self.shared.config.concurrency.min(self.shared.config.batch);
        let mut request = ReceiveRequest::up_to(max);
        request.visibility = self.shared.config.visibility;
        let messages = match self.shared.queue.receive(request).await {
            Ok(messages) => messages,
            Err(e) => {
                self.shared.count_failed_receive(&call);
                return Err(e);
            }
        };
        let mut tasks = JoinSet::new();
        for message in messages {
            let shared = self.shared.clone();
            let call = call.clone();
            tasks
                .spawn(async move { shared.process(message, std::future::pending(), &call).await });
        }
        while let Some(joined) = tasks.join_next().await {
            if joined.is_err() {
                self.shared.bump(&call, |c| &c.failed);
            }
        }
        Ok(call.snapshot())
    }

    /// Runs until `shutdown` resolves: receives while a handler slot is
    /// free, then, on shutdown, stops receiving, lets in-flight handlers
    /// finish within `shutdown_deadline` and abandons the rest; messages
    /// it received but does not handle are handed back at once (module
    /// docs, Shutdown). Returns what this call did. A receive that fails
    /// is counted and retried after a second; the log has the first of a
    /// run of failures, then a line a minute at most, then the recovery
    /// (module docs, Failed receives).
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> WorkerCounters {
        // This call's own counters, as in `run_once`.
        let call = Arc::new(Counters::default());
        let config = &self.shared.config;
        let slots = Arc::new(Semaphore::new(config.concurrency));
        let mut tasks = JoinSet::new();
        // Raised on shutdown: a receive under way stops.
        let (stopping, stop) = watch::channel(false);
        // Raised at the deadline: handlers still running are abandoned.
        let (abandoning, abandon) = watch::channel(false);
        tokio::pin!(shutdown);
        // The run of failed receives going on, if any, for the log.
        let mut failing = Failures::default();
        // The receive under way when the shutdown came, if any.
        let receiving = loop {
            while let Some(joined) = tasks.try_join_next() {
                if joined.is_err() {
                    self.shared.bump(&call, |c| &c.failed);
                }
            }
            // `biased`: shutdown is looked at first. Unbiased, select!
            // polls its branches in random order, so a shutdown that
            // was already due could lose to a slot that freed at the same
            // time (a handler finishing after it), and the worker began a
            // receive after the shutdown.
            let first = tokio::select! {
                biased;
                _ = &mut shutdown => break None,
                permit = slots.clone().acquire_owned() => permit.expect("never closed"),
            };
            let mut permits = vec![first];
            while permits.len() < config.batch {
                match slots.clone().try_acquire_owned() {
                    Ok(p) => permits.push(p),
                    Err(_) => break,
                }
            }
            let mut request = ReceiveRequest::up_to(permits.len()).wait(config.wait);
            request.visibility = config.visibility;
            // Told to stop, not dropped, at shutdown: dropped with its
            // statement running, what that statement delivered would reach
            // nobody and wait out its visibility timeout.
            let mut receive = Box::pin(
                self.shared
                    .queue
                    .receive_or_stop(request, raised(stop.clone())),
            );
            let received = tokio::select! {
                biased;
                _ = &mut shutdown => break Some(receive),
                r = &mut receive => r,
            };
            match received {
                Ok(messages) => {
                    if let Some(run) = failing.succeeded() {
                        tracing::info!(queue = self.shared.queue.name(), failed = run.count, since = %run.since,
                            "receive recovered after {} failed receives since {}", run.count, run.since);
                    }
                    for message in messages {
                        let permit = permits.pop().expect("no more messages than permits");
                        let shared = self.shared.clone();
                        let abandon = raised(abandon.clone());
                        let call = call.clone();
                        tasks.spawn(async move {
                            shared.process(message, abandon, &call).await;
                            drop(permit);
                        });
                    }
                }
                Err(e) => {
                    self.shared.count_failed_receive(&call);
                    let queue = self.shared.queue.name();
                    match failing
                        .failed(tokio::time::Instant::now(), time::OffsetDateTime::now_utc())
                    {
                        Failure::First => tracing::warn!(queue, error = %e,
                            "receive failed; retrying every second"),
                        Failure::StillFailing(run) => {
                            tracing::warn!(queue, failed = run.count, since = %run.since, error = %e,
                            "receives still failing: {} failed since {}; retrying every second", run.count, run.since)
                        }
                        Failure::Quiet => {
                            tracing::debug!(queue, error = %e, "receive failed; retrying")
                        }
                    }
                    tokio::select! {
                        biased;
                        _ = &mut shutdown => break None,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        };
        let _ = stopping.send(true);
        tracing::info!(
            queue = self.shared.queue.name(),
            in_flight = tasks.len(),
            receiving = receiving.is_some(),
            "worker shutting down"
        );
        let overran = {
            // What a receive under way delivered is not handled: the
            // worker is stopping. It is handed back for another worker.
            let received_late = async {
                let Some(receive) = receiving else { return };
                match receive.await {
                    Ok(messages) => {
                        futures::future::join_all(
                            messages
                                .iter()
                                .map(|m| self.shared.release(m, "received at shutdown", &call)),
                        )
                        .await;
                    }
                    Err(e) => {
                        self.shared.count_failed_receive(&call);
                        tracing::warn!(queue = self.shared.queue.name(), error = %e, "receive failed at shutdown")
                    }
                }
            };
            let drained = async {
                while let Some(joined) = tasks.join_next().await {
                    if joined.is_err() {
                        self.shared.bump(&call, |c| &c.failed);
                    }
                }
            };
            let all = futures::future::join(received_late, drained);
            tokio::pin!(all);
            // `timeout`, not a deadline of now plus `shutdown_deadline`:
            // one too long for the clock (`Duration::MAX`, to wait for
            // ever) overflowed that sum and panicked, dropping the
            // handlers with the run; `timeout` waits for ever instead.
            if tokio::time::timeout(config.shutdown_deadline, &mut all)
                .await
                .is_err()
            {
                tracing::warn!(
                    queue = self.shared.queue.name(),
                    "shutdown deadline passed; abandoning the handlers still running and handing their messages back"
                );
                let _ = abandoning.send(true);
                tokio::time::timeout(SHUTDOWN_GRACE, &mut all)
                    .await
                    .is_err()
            } else {
                false
            }
        };
        if overran {
            tracing::warn!(
                queue = self.shared.queue.name(),
                left = tasks.len(),
                "acks and hand-backs still under way after the grace, dropped; their messages return after their visibility timeout"
            );
        }
        tasks.shutdown().await;
        call.snapshot()
    }
}

/// After the shutdown deadline, how long [`Worker::run`] still waits for
/// what abandoning handlers leaves under way: acks, heartbeats in flight,
/// the hand-back of each abandoned message, a receive still running. Each
/// is a statement or two, not a handler: this bounds a stuck one. (A long
/// poll that cannot be stopped is the exception: it runs its `wait`,
/// `WorkerConfig::shutdown_deadline` says so.) Stated on
/// `WorkerConfig::shutdown_deadline`, where users set the deadline.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Resolves once `signal` is raised (set to true), or never when its
/// sender is gone unraised.
async fn raised(mut signal: watch::Receiver<bool>) {
    if signal.wait_for(|raised| *raised).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// How long a delivery lasts, as far as the worker knows: until the
/// visibility the last request that set it asked for, counted from when
/// that request was made (the server counts from later, so this end is
/// never past the real one). Unknown (never run out) while no request with
/// a known visibility went through: the backend did not state the
/// visibility of the delivery, and the worker asked for none.
#[derive(Default)]
struct Lease(std::sync::Mutex<Option<Instant>>);

impl Lease {
    /// A request made at `asked_at` made the delivery last `visibility`
    /// (zero: it ended, refused as stale).
    fn set(&self, asked_at: Instant, visibility: Duration) {
        // An end past the clock's (never, with visibilities of at most
        // 12 h) is unknown.
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = asked_at.checked_add(visibility);
    }

    /// Whether the delivery has certainly run out.
    fn ran_out(&self) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|until| until <= Instant::now())
    }
}

/// One handler on the gauge `pgonce_queue_worker_in_flight` for as long as
/// it lives: dropped when its handler ends, is abandoned, or its task is
/// dropped, so no way out leaves it counted.
struct Running(metrics::Gauge);

impl Running {
    fn new(gauge: metrics::Gauge) -> Running {
        gauge.increment(1.0);
        Running(gauge)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

impl<Q: Queue, H: Handler> Shared<Q, H> {
    /// Counts one `which` for the call whose counters are `call` and for
    /// the worker, over all its calls.
    fn bump(&self, call: &Counters, which: fn(&Counters) -> &AtomicU64) {
        for counters in [call, &self.counters] {
            which(counters).fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a failed receive for the call whose counters are `call`, for
    /// the worker, and in `pgonce_queue_worker_failed_receives_total`.
    fn count_failed_receive(&self, call: &Counters) {
        self.bump(call, |c| &c.failed_receives);
        metrics::counter!("pgonce_queue_worker_failed_receives_total", "queue" => self.queue.name().to_string())
            .increment(1);
    }

    /// Extends `message`'s visibility every `heartbeat_interval` until
    /// `stop` is notified, which it looks at between beats only: a beat in
    /// flight is finished. Stops beating (and waits for `stop`) once a beat
    /// is refused as stale, or once `lease` has run out before a beat, and
    /// never beats without a heartbeat. Each beat that went through extends
    /// `lease`; a stale one ends it.
    ///
    /// A delivery that ran out (its beats failed, or came too late) is
    /// visible again, or another worker's. A beat then is refused where
    /// receipts are fenced, but on SQS, which takes an earlier delivery's
    /// receipt, it would set the other worker's delivery to end
    /// `heartbeat_extension` from now, whatever visibility that worker
    /// asked for; and, going through, it would make the lease look alive
    /// again, so the hand-back at the shutdown deadline or a failure's
    /// visibility would act on the other delivery too. So none is sent.
    /// (The worker's end of a delivery comes before the server's, counted
    /// from before its request was made: a beat sent before it is late
    /// only if it takes longer to reach the server than that margin.)
    async fn heartbeat(
        &self,
        message: &Received,
        queue: &str,
        stop: &Notify,
        lease: &Lease,
        call: &Counters,
    ) {
        if let Some(every) = self.config.heartbeat_interval {
            loop {
                tokio::select! {
                    biased;
                    () = stop.notified() => return,
                    () = tokio::time::sleep(every) => {}
                }
                if lease.ran_out() {
                    self.bump(call, |c| &c.expired);
                    tracing::warn!(queue = %queue, id = %message.id,
                        "heartbeat stopped: the delivery ran out while its handler ran (its beats failed or came late); the message may be delivered again");
                    break;
                }
                let asked_at = Instant::now();
                match self
                    .queue
                    .change_visibility(&message.receipt, self.config.heartbeat_extension)
                    .await
                {
                    Ok(()) => {
                        lease.set(asked_at, self.config.heartbeat_extension);
                        self.bump(call, |c| &c.heartbeats)
                    }
                    Err(Error::StaleReceipt { .. }) => {
                        lease.set(asked_at, Duration::ZERO);
                        self.bump(call, |c| &c.stale);
                        tracing::warn!(queue = %queue, id = %message.id,
                            "heartbeat refused: the message was redelivered while its handler ran");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(queue = %queue, id = %message.id, error = %e, "heartbeat failed")
                    }
                }
            }
        }
        stop.notified().await
    }

    /// Hands `message` back unhandled, visible again at once (`why`: for
    /// the log); counted in [`WorkerCounters::released`] of `call`.
    async fn release(&self, message: &Received, why: &str, call: &Counters) {
        let released = self
            .queue
            .change_visibility(&message.receipt, Duration::ZERO)
            .await;
        if self.went_through(released, message, why, call) {
            self.bump(call, |c| &c.released);
        }
    }

    /// Whether `outcome`, of an ack or a hand-back of `message` (`what`),
    /// went through; a refusal is logged, and counted for `call` when stale.
    fn went_through(
        &self,
        outcome: Result<()>,
        message: &Received,
        what: &str,
        call: &Counters,
    ) -> bool {
        let queue = self.queue.name();
        match outcome {
            Ok(()) => true,
            Err(Error::StaleReceipt { .. }) => {
                self.bump(call, |c| &c.stale);
                tracing::warn!(queue = %queue, id = %message.id, what,
                    "refused: the message was redelivered meanwhile");
                false
            }
            Err(e) => {
                tracing::warn!(queue = %queue, id = %message.id, what, error = %e,
                    "failed; the message returns after its visibility timeout");
                false
            }
        }
    }

    /// Handles `message` and acks it; or, once `abandon` resolves with the handler still
    /// running, drops the handler and hands the message back, unless its
    /// delivery ran out meanwhile (module docs, Shutdown). Counted for the
    /// call whose counters are `call`.
    async fn process(&self, message: Received, abandon: impl Future<Output = ()>, call: &Counters) {
        let queue = self.queue.name().to_string();
        self.bump(call, |c| &c.received);
        metrics::counter!("pgonce_queue_worker_received_total", "queue" => queue.clone())
            .increment(1);
        if message.receive_count > 1 {
            self.bump(call, |c| &c.redelivered);
            metrics::counter!("pgonce_queue_worker_redelivered_total", "queue" => queue.clone())
                .increment(1);
        }
        let running = Running::new(
            metrics::gauge!("pgonce_queue_worker_in_flight", "queue" => queue.clone()),
        );
        let started = Instant::now();
        // The heartbeat runs beside the handler, not in turns with it: a
        // beat is a statement that can wait (on the message's row lock, on
        // a connection of an exhausted pool), and the handler must go on
        // meanwhile. When the handler ends, a beat in flight is finished
        // before the ack: dropped, its statement could still reach the
        // database after the ack's and undo a visibility the ack set.
        // A panic is caught here, the handler's future dropped with it: the
        // handler failed, and its message gets what any failure gets.
        // Abandoned, the handler's future is dropped before the beat is
        // awaited: what it holds (a connection, a transaction) goes back
        // at once. `biased`, handler first: one that finished as the
        // deadline passed is acked, not abandoned.
        // The delivery's end, from the visibility the backend says it got
        // (the queue's, when the worker asked for none): without it, a
        // delivery whose early beats failed would look alive for ever,
        // and a beat sent after it ran out would, where receipts are not
        // fenced (SQS), extend or cut short another worker's delivery.
        // Counted from when the backend sent what delivered it, not from
        // the receive's start: a long poll's wait before that is not the
        // delivery's, and counted, it made a message delivered late in
        // the wait look run out at its first beat, its heartbeat stopped.
        let lease = Lease::default();
        if let Some(visibility) = message.visibility.or(self.config.visibility) {
            lease.set(message.requested_at, visibility);
        }
        if let (Some(every), Some(visibility)) =
            (self.config.heartbeat_interval, message.visibility)
            && every >= visibility
            && !self.beats_too_seldom.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(queue = %queue, ?every, ?visibility,
                "heartbeat_interval is not shorter than the queue's visibility timeout: deliveries run out before their first beat, and their heartbeats stop; set a shorter interval or WorkerConfig::visibility");
        }
        let caught = {
            let stop = Notify::new();
            let mut handling =
                Box::pin(AssertUnwindSafe(self.handler.handle(&message)).catch_unwind());
            let heartbeat = self.heartbeat(&message, &queue, &stop, &lease, call);
            tokio::pin!(heartbeat, abandon);
            let caught = tokio::select! {
                biased;
                caught = &mut handling => Some(caught),
                () = &mut heartbeat => unreachable!("the heartbeat ends only when stopped"),
                () = &mut abandon => None,
            };
            // Dropping the handler runs its destructors, which can panic
            // too (a guard that checks on drop that its work was done):
            // caught, or it ended this task before the beat in flight
            // was finished and the message acked or handed back. The
            // panic is the handler's: it failed, or was abandoned, all
            // the same.
            if std::panic::catch_unwind(AssertUnwindSafe(|| drop(handling))).is_err() {
                tracing::warn!(queue = %queue, id = %message.id, "the handler panicked as it was dropped");
            }
            if caught.is_some() {
                metrics::histogram!("pgonce_queue_worker_handler_seconds", "queue" => queue.clone())
                    .record(started.elapsed().as_secs_f64());
            }
            stop.notify_one();
            heartbeat.await;
            caught
        };
        drop(running);
        let Some(caught) = caught else {
            self.bump(call, |c| &c.abandoned);
            // A delivery that ran out is visible again already, or is
            // another worker's now: handing it back would gain nothing,
            // and on a backend that does not fence receipts (SQS) it would
            // make the other worker's delivery visible, for a third to
            // take while the second still handles it.
            if lease.ran_out() {
                tracing::warn!(queue = %queue, id = %message.id,
                    "shutdown deadline passed: handler abandoned; its delivery ran out meanwhile, so its message is not handed back");
                return;
            }
            tracing::warn!(queue = %queue, id = %message.id,
                "shutdown deadline passed: handler abandoned, its message handed back");
            self.release(
                &message,
                "hand-back of an abandoned handler's message",
                call,
            )
            .await;
            return;
        };
        let panicked = caught.is_err();
        let outcome = caught.unwrap_or_else(|payload| {
            let what = crate::service::panic_message(&*payload);
            Err(format!("handler panicked: {what}").into())
        });
        // A handler whose job claim found the job in another delivery's
        // hands keeps its message whatever the policy, and makes it visible
        // again when the job can be claimable at the earliest (the holder's
        // lease expiry, a retry's run_at). The JobBusy may be the error
        // itself or one of its causes: handlers wrap errors in their own.
        // Not when the handler says it recorded its job's failed attempt:
        // a JobBusy among that failure's causes is another job's (the
        // work waited on one), and the row drives this job's retry.
        let busy_until = outcome
            .as_ref()
            .err()
            .filter(|e| !failure_recorded(&***e))
            .and_then(|e| job_busy_until(&**e));
        let delete = match &outcome {
            Ok(()) => {
                self.bump(call, |c| &c.succeeded);
                true
            }
            Err(e) if busy_until.is_some() => {
                self.bump(call, |c| &c.failed);
                tracing::debug!(queue = %queue, id = %message.id, error = %e,
                    "job busy: message kept for redelivery");
                false
            }
            Err(e) => {
                self.bump(call, |c| &c.failed);
                metrics::counter!("pgonce_queue_worker_failed_total", "queue" => queue.clone())
                    .increment(1);
                tracing::warn!(queue = %queue, id = %message.id, receive_count = message.receive_count,
                    error = %e, "handler failed");
                // A handler that panicked, whose transaction PostgreSQL
                // aborted (a retryable error) or whose wait for a row ran
                // past the lock_timeout recorded nothing: its message is
                // kept whatever the policy, as if its process had died.
                // Unless the handler says it recorded the job's failure
                // (job::FailureRecorded) whatever caused it: then the
                // row drives the retry (the re-driver makes the job
                // pending once due), and a kept message would deliver the
                // job a second time per attempt.
                !panicked
                    && (failure_recorded(&**e) || !pgonce_errors(&**e).any(recorded_nothing))
                    && self.config.ack == AckPolicy::AlwaysDelete
            }
        };
        // A failure's visibility change on a delivery that ran out would
        // act on another worker's delivery where receipts are not fenced
        // (SQS): made visible again, for a third worker to take while the
        // second still handles it. The message is visible again already,
        // or is that worker's now; nothing to change. (A delete still
        // goes out: the work is done, as with any late ack.)
        let keep_as_is = !delete && lease.ran_out();
        if keep_as_is {
            tracing::warn!(queue = %queue, id = %message.id,
                "handler failed after its delivery ran out: its visibility is left as it is");
        }
        let acked = if keep_as_is {
            Ok(())
        } else if delete {
            self.queue.delete(&message.receipt).await.map(|()| {
                self.bump(call, |c| &c.deleted);
                metrics::counter!("pgonce_queue_worker_deleted_total", "queue" => queue.clone())
                    .increment(1);
            })
        } else if let Some(not_before) = busy_until {
            self.queue
                .change_visibility(&message.receipt, visible_again_at(not_before))
                .await
        } else if let Some(after) = self.config.failure_visibility {
            self.queue.change_visibility(&message.receipt, after).await
        } else {
            Ok(())
        };
        self.went_through(acked, &message, "ack", call);
    }
}

/// `error`'s chain of sources, `error` included.
fn sources<'e>(
    error: &'e (dyn std::error::Error + Send + Sync + 'static),
) -> impl Iterator<Item = &'e (dyn std::error::Error + 'static)> {
    let first: &'e (dyn std::error::Error + 'static) = error;
    std::iter::successors(Some(first), |e| e.source())
}

/// The pgonce [`Error`]s in `error`'s chain of sources, `error` included.
fn pgonce_errors<'e>(
    error: &'e (dyn std::error::Error + Send + Sync + 'static),
) -> impl Iterator<Item = &'e Error> {
    sources(error).filter_map(|e| e.downcast_ref::<Error>())
}

/// Whether `error`'s chain of sources, `error` included, holds a
/// [`crate::job::FailureRecorded`]: the handler recorded its job's failed
/// attempt on the row.
fn failure_recorded(error: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    sources(error).any(|e| e.is::<crate::job::FailureRecorded>())
}

/// The `not_before` of the first [`Error::JobBusy`] in `error`'s chain of
/// sources, `error` included.
fn job_busy_until(
    error: &(dyn std::error::Error + Send + Sync + 'static),
) -> Option<time::OffsetDateTime> {
    pgonce_errors(error).find_map(|e| match e {
        Error::JobBusy { not_before, .. } => Some(*not_before),
        _ => None,
    })
}

/// Whether `error` says the attempt recorded nothing, so that its message
/// is kept under either policy: a retryable error (PostgreSQL rolled the
/// transaction back, a send sent nothing) or a row wait given up past the
/// session's `lock_timeout` (the statement wrote nothing, and the message
/// is what drives the job once the row's holder is done, as the job
/// module's Waits section says), or a statement cut by the session's
/// `statement_timeout` or canceled (PostgreSQL undid its work, and the
/// same holds for the message), or a lost connection (see
/// [`connection_lost`]), or a pooler in front of PostgreSQL that could not
/// run the statement ([`Error::Pooler`]: PgBouncer finding no server to
/// log in to, while PostgreSQL restarts or refuses logins, is one; its
/// statement did not run, or its answer was lost as with a lost
/// connection), or a lease lost (the write under it wrote nothing; the
/// reaper may have made the job pending with nobody holding it, and the
/// message's next delivery claims it then, or hears that another holds it
/// or is done).
fn recorded_nothing(error: &Error) -> bool {
    error.is_retryable()
        || matches!(
            error,
            Error::LockNotAvailable { .. }
                | Error::QueryCanceled { .. }
                | Error::LeaseLost { .. }
                | Error::Pooler { .. }
        )
        || matches!(error, Error::Database(e) if connection_lost(e))
}

/// Whether `e` says the connection to PostgreSQL was lost or never had:
/// the socket or TLS failed, the server ended the session (SQLSTATE class
/// 08, or 57P01 to 57P03: shut down, crashed, starting up; or any error
/// of severity FATAL or PANIC, which ends the session whatever its code:
/// `idle_in_transaction_session_timeout`'s 25P03, `idle_session_timeout`'s
/// 57P05, a backend terminated), or no connection came from the pool. The
/// handler could record nothing more on it, as if its process had died:
/// the transaction open on it rolled back (a claim made in it included,
/// the job pending again), and whatever it had claimed and committed is
/// left to the lease's end, and to its message, which claims the job then.
/// Its last statement's outcome is unknown (a commit whose answer was
/// lost): a message kept then is one delivery more, which the claim
/// answers.
fn connection_lost(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(_) => crate::error::session_ended(e),
        _ => false,
    }
}

/// How long a message of a busy job stays invisible: until `not_before`,
/// at least a second (clocks of the database and the worker differ) and at
/// most 12 h (SQS's limit).
fn visible_again_at(not_before: time::OffsetDateTime) -> Duration {
    let secs = (not_before - time::OffsetDateTime::now_utc()).as_seconds_f64();
    Duration::from_secs_f64(secs.clamp(1.0, 12.0 * 3600.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Error, Result};

    #[test]
    fn always_delete_deletes_failures_and_delete_on_success_keeps_them() {
        let failed: Result<()> = Err(Error::Invalid {
            what: "x",
            why: "y".into(),
        });
        let handled: Result<()> = Err(Error::AlreadyHandled {
            job_id: 1,
            expected: "pending",
        });
        assert!(AckPolicy::AlwaysDelete.delete_message(&failed));
        assert!(!AckPolicy::DeleteOnSuccess.delete_message(&failed));
        assert!(AckPolicy::DeleteOnSuccess.delete_message(&handled));
        assert!(AckPolicy::DeleteOnSuccess.delete_message(&Ok(())));
        let busy: Result<()> = Err(Error::JobBusy {
            job_id: 1,
            status: crate::job::JobStatus::Processing,
            not_before: time::OffsetDateTime::now_utc(),
        });
        assert!(!AckPolicy::DeleteOnSuccess.delete_message(&busy));
        assert!(!AckPolicy::AlwaysDelete.delete_message(&busy));
    }

    #[test]
    fn a_lost_connection_keeps_the_message_under_either_policy() {
        let lost: Result<()> = Err(Error::Database(sqlx::Error::PoolTimedOut));
        assert!(!AckPolicy::AlwaysDelete.delete_message(&lost));
        assert!(!AckPolicy::DeleteOnSuccess.delete_message(&lost));
        let lost: Result<()> = Err(Error::LeaseLost {
            resource: "job 1".into(),
        });
        assert!(!AckPolicy::AlwaysDelete.delete_message(&lost));
        let lost: Result<()> = Err(Error::Pooler {
            problem: crate::PoolerProblem::ServerUnreachable,
            message: "server login has been failing".into(),
        });
        assert!(!AckPolicy::AlwaysDelete.delete_message(&lost));
        let refused: Result<()> = Err(Error::Database(sqlx::Error::RowNotFound));
        assert!(AckPolicy::AlwaysDelete.delete_message(&refused));
    }

    #[test]
    fn a_heartbeat_must_outlast_the_wait_for_the_next_one() {
        let ok = WorkerConfig::default();
        ok.validate().unwrap();
        for extension in [
            Duration::ZERO,
            Duration::from_secs(10),
            Duration::from_secs(13 * 3600),
        ] {
            let bad = WorkerConfig {
                heartbeat_extension: extension,
                ..ok.clone()
            };
            assert!(bad.validate().is_err(), "{extension:?}");
        }
        let no_heartbeat = WorkerConfig {
            heartbeat_interval: None,
            heartbeat_extension: Duration::ZERO,
            ..ok
        };
        no_heartbeat.validate().unwrap();
    }

    /// A heartbeat under a millisecond would beat in a busy loop of
    /// statements: refused, named.
    #[test]
    fn a_heartbeat_interval_under_a_millisecond_is_refused() {
        for interval in [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_micros(999),
        ] {
            let bad = WorkerConfig {
                heartbeat_interval: Some(interval),
                ..WorkerConfig::default()
            };
            match bad.validate() {
                Err(Error::Invalid { what, .. }) => {
                    assert_eq!(what, "worker config heartbeat_interval")
                }
                other => panic!("{interval:?}: {other:?}"),
            }
        }
        let shortest = WorkerConfig {
            heartbeat_interval: Some(Duration::from_millis(1)),
            ..WorkerConfig::default()
        };
        shortest.validate().unwrap();
    }
}
