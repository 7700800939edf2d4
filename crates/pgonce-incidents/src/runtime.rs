//! The service's background work in one place: pipeline workers on the
//! observations queue, the notifier, the job reaper and re-driver that
//! keep notifications from being lost, and the pipeline ledger's cleaner
//! when one is configured. `pgonce serve`, `pgonce worker` and
//! `pgonce demo` start it; [`Runtime::shutdown`] stops it gracefully.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use futures::FutureExt;
use pgonce::job::{Reaper, ReaperConfig, Redriver, RedriverConfig};
use pgonce::{
    PgQueue, PgQueueOptions, Queue, QueueAttributes, Worker, WorkerConfig, WorkerCounters,
};
use pgonce_sqs::{SqsClient, SqsQueue};
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::SqsSection;
use crate::error::{Error, Result};
use crate::notifier::{Notifier, NotifierConfig, NotifyCounts};
use crate::pipeline::{
    Evaluator, LedgerCleanerConfig, ObservationHandler, PipelineCounters, SimulatedEvaluator,
    SimulatedEvaluatorConfig, forget_processed,
};
use crate::service::Service;

/// The pipeline's FIFO queue (message group: organization/entity).
pub const OBSERVATIONS_QUEUE: &str = "incidents-observations";
/// Where observations go after `max_receive_count` failed deliveries.
pub const OBSERVATIONS_DEAD_LETTERS: &str = "incidents-observations-dead";

/// Creates (or updates) the observations queue and its dead-letter queue in
/// PostgreSQL: FIFO, the given visibility timeout, dead-lettered after
/// `max_receive_count` deliveries.
pub async fn observations_queue(
    pool: &PgPool,
    visibility: Duration,
    max_receive_count: u32,
) -> Result<PgQueue> {
    observations_queue_with(
        pool,
        visibility,
        max_receive_count,
        PgQueueOptions::default(),
    )
    .await
}

/// [`observations_queue`] with the handle's options (LISTEN on or off, on
/// which URL, how often to re-poll).
pub async fn observations_queue_with(
    pool: &PgPool,
    visibility: Duration,
    max_receive_count: u32,
    options: PgQueueOptions,
) -> Result<PgQueue> {
    PgQueue::create(
        pool,
        OBSERVATIONS_DEAD_LETTERS,
        QueueAttributes::fifo(),
        options.clone(),
    )
    .await?;
    Ok(PgQueue::create(
        pool,
        OBSERVATIONS_QUEUE,
        QueueAttributes::fifo()
            .visibility_timeout(visibility)
            .dead_letter(OBSERVATIONS_DEAD_LETTERS, max_receive_count),
        options,
    )
    .await?)
}

/// The observations queue on Amazon SQS, as `[queue.sqs]` names it: FIFO
/// (group: the entity, as on PostgreSQL), the given visibility timeout,
/// dead-lettered after `max_receive_count` deliveries. With
/// `section.create`, both queues are created when missing (SQS keeps an
/// existing queue whose attributes match, and refuses different ones);
/// otherwise opened, [`pgonce::Error::QueueNotFound`] when missing.
///
/// The pipeline keeps its invariants on SQS with what SQS lacks carried by
/// the database: no receipt fencing (a redelivery's first, stale worker may
/// still delete the message; it does so only after its own work committed,
/// and the guard caught the second), and a fixed 5-minute deduplication
/// window (a later resend is a new message: the pipeline keys what a
/// message opened by the observation's own `message_id` when the producer
/// gives one, and the guard keeps singleton policies at one OPEN incident
/// whatever the queue delivers).
pub async fn sqs_observations_queue(
    sqs: &SqsClient,
    section: &SqsSection,
    visibility: Duration,
    max_receive_count: u32,
) -> Result<SqsQueue> {
    if !section.create {
        return Ok(sqs.open(section.queue_name()).await?);
    }
    sqs.create_queue(section.dead_letter_name(), QueueAttributes::fifo())
        .await?;
    Ok(sqs
        .create_queue(
            section.queue_name(),
            QueueAttributes::fifo()
                .visibility_timeout(visibility)
                .dead_letter(section.dead_letter_name(), max_receive_count),
        )
        .await?)
}

/// What to run.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Pipeline workers (each a [`Worker`] with `worker.concurrency`
    /// handlers). Default 2; 0 runs no pipeline.
    pub workers: usize,
    /// Settings of each pipeline worker. Default [`WorkerConfig::default`].
    pub worker: WorkerConfig,
    /// The policy evaluator the pipeline uses. Default
    /// [`SimulatedEvaluatorConfig::default`].
    pub evaluator: SimulatedEvaluatorConfig,
    /// `None`: no notifier in this process.
    pub notifier: Option<NotifierConfig>,
    /// Run the job reaper and re-driver here. Default true.
    pub job_maintenance: bool,
    /// The job reaper's settings (with `job_maintenance`). Default
    /// [`ReaperConfig::default`].
    pub reaper: ReaperConfig,
    /// The job re-driver's settings (with `job_maintenance`). Default
    /// [`RedriverConfig::default`].
    pub redriver: RedriverConfig,
    /// Run the pipeline ledger's cleaner here, with these settings
    /// ([`crate::pipeline::forget_processed`]). Default `None`: the
    /// ledger is kept for good.
    pub ledger_cleaner: Option<LedgerCleanerConfig>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            workers: 2,
            worker: WorkerConfig::default(),
            evaluator: SimulatedEvaluatorConfig::default(),
            notifier: None,
            job_maintenance: true,
            reaper: ReaperConfig::default(),
            redriver: RedriverConfig::default(),
            ledger_cleaner: None,
        }
    }
}

/// What a runtime did, when it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuntimeSummary {
    /// The pipeline workers' counters, summed over every worker.
    pub workers: WorkerCounters,
    /// The notifier's counts, summed over its passes; zero without a notifier.
    pub notifications: NotifyCounts,
}

/// What a runtime has not finished yet: for a caller whose own bound on
/// its stop ran out, to say what it abandoned ([`RuntimeProgress`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Unfinished {
    /// Pipeline workers still running or stopping.
    pub pipeline_workers: usize,
    /// Whether the notifier is.
    pub notifier: bool,
    /// Job reaper and re-driver loops still running or stopping.
    pub job_maintenance: usize,
    /// Whether the ledger's cleaner is.
    pub ledger_cleaner: bool,
}

impl Unfinished {
    /// Whether everything finished.
    pub fn is_empty(&self) -> bool {
        *self == Unfinished::default()
    }
}

/// Which of a runtime's tasks are still going; see [`Runtime::progress`].
#[derive(Default)]
struct Left {
    pipeline_workers: AtomicUsize,
    notifier: AtomicBool,
    job_maintenance: AtomicUsize,
    ledger_cleaner: AtomicBool,
}

/// A runtime's [`Unfinished`] tasks, readable while it stops and after it
/// is dropped.
#[derive(Clone)]
pub struct RuntimeProgress(Arc<Left>);

impl RuntimeProgress {
    /// What has not finished yet.
    pub fn unfinished(&self) -> Unfinished {
        Unfinished {
            pipeline_workers: self.0.pipeline_workers.load(Ordering::Relaxed),
            notifier: self.0.notifier.load(Ordering::Relaxed),
            job_maintenance: self.0.job_maintenance.load(Ordering::Relaxed),
            ledger_cleaner: self.0.ledger_cleaner.load(Ordering::Relaxed),
        }
    }
}

enum Finished {
    Worker(WorkerCounters),
    Notifier(NotifyCounts),
    Other,
}

/// Running background work; see the module docs. Dropping it aborts every
/// task at once, as a crash would: messages being handled come back after
/// their visibility timeout, claimed notifications after their lease.
pub struct Runtime {
    stop: watch::Sender<bool>,
    tasks: JoinSet<Finished>,
    pipeline: Arc<PipelineCounters>,
    left: Arc<Left>,
}

impl Runtime {
    /// Starts everything `config` asks for on `queue` (any [`Queue`]: the
    /// PostgreSQL one or Amazon SQS), evaluating policies with the
    /// [`SimulatedEvaluator`] that `config.evaluator` describes.
    pub fn start<Q>(service: &Service, queue: Q, config: RuntimeConfig) -> Result<Runtime>
    where
        Q: Queue + Clone + 'static,
    {
        let evaluator = SimulatedEvaluator::new(config.evaluator.clone())?;
        Runtime::start_with(service, queue, config, evaluator)
    }

    /// [`Runtime::start`] with your own [`Evaluator`] (real remote calls, a
    /// model, a rules engine); `config.evaluator` is then unused. The
    /// evaluator runs with no database connection held, however long it
    /// takes: the guarded write checks afterwards that what it decided on
    /// still holds.
    pub fn start_with<Q, E>(
        service: &Service,
        queue: Q,
        config: RuntimeConfig,
        evaluator: E,
    ) -> Result<Runtime>
    where
        Q: Queue + Clone + 'static,
        E: Evaluator,
    {
        let (stop, stopped) = watch::channel(false);
        let until_stopped = move || {
            let mut rx = stopped.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let handler = ObservationHandler::new(service.clone(), evaluator);
        let pipeline = handler.counters();
        let mut tasks = JoinSet::new();
        let left = Arc::new(Left::default());
        for _ in 0..config.workers {
            let worker = Worker::new(queue.clone(), handler.clone(), config.worker.clone())?;
            let shutdown = until_stopped();
            let left = left.clone();
            left.pipeline_workers.fetch_add(1, Ordering::Relaxed);
            tasks.spawn(async move {
                let counters = worker.run(shutdown).await;
                left.pipeline_workers.fetch_sub(1, Ordering::Relaxed);
                Finished::Worker(counters)
            });
        }
        if let Some(notifier_config) = config.notifier {
            let notifier = Notifier::new(service, notifier_config)?;
            let shutdown = until_stopped();
            let left = left.clone();
            left.notifier.store(true, Ordering::Relaxed);
            tasks.spawn(async move {
                let counts = notifier.run(shutdown).await;
                left.notifier.store(false, Ordering::Relaxed);
                Finished::Notifier(counts)
            });
        }
        if config.job_maintenance {
            let reaper = Reaper::new(service.pool().clone(), config.reaper)?;
            let redriver = Redriver::new(service.pool().clone(), config.redriver)?;
            left.job_maintenance.fetch_add(2, Ordering::Relaxed);
            // Each loop is raced against the stop rather than handed it:
            // it hears its shutdown between passes only, and a pass waiting
            // on a lock (`pgonce.jobs` locked by a migration) held the stop
            // for as long as the lock was held. Dropped, a pass leaves
            // nothing half done: each of its statements is a transaction
            // of its own, which rolls back.
            let loops = [
                reaper.run(std::future::pending()).boxed(),
                redriver.run(std::future::pending()).boxed(),
            ];
            for one in loops {
                let (shutdown, left) = (until_stopped(), left.clone());
                tasks.spawn(async move {
                    tokio::select! {
                        () = one => {}
                        () = shutdown => {}
                    }
                    left.job_maintenance.fetch_sub(1, Ordering::Relaxed);
                    Finished::Other
                });
            }
        }
        if let Some(ledger) = config.ledger_cleaner {
            ledger.validate()?;
            let (pool, shutdown, left) = (service.pool().clone(), until_stopped(), left.clone());
            left.ledger_cleaner.store(true, Ordering::Relaxed);
            // Raced against the stop, as the job loops are: a pass is
            // dropped at its current batch, a statement that rolls back.
            tasks.spawn(async move {
                let passes = pgonce::service::run_every(
                    "incidents ledger cleaner",
                    ledger.interval,
                    std::future::pending(),
                    || forget_processed(&pool, &ledger),
                );
                tokio::select! {
                    () = passes => {}
                    () = shutdown => {}
                }
                left.ledger_cleaner.store(false, Ordering::Relaxed);
                Finished::Other
            });
        }
        Ok(Runtime {
            stop,
            tasks,
            pipeline,
            left,
        })
    }

    /// The pipeline's counters, live.
    pub fn pipeline(&self) -> Arc<PipelineCounters> {
        self.pipeline.clone()
    }

    /// What of this runtime has not finished yet, readable while
    /// [`Runtime::shutdown`] runs, and once it was dropped unfinished (by
    /// a caller whose own bound on the stop ran out, to say what it
    /// abandoned).
    pub fn progress(&self) -> RuntimeProgress {
        RuntimeProgress(self.left.clone())
    }

    /// Stops receiving, lets in-flight handlers finish (within the worker's
    /// shutdown deadline, their acks and hand-backs within 5 s more:
    /// [`WorkerConfig::shutdown_deadline`]) and the notifier's pass in
    /// flight (within its lease), drops the job reaper's, the re-driver's
    /// and the ledger cleaner's passes under way (each statement a
    /// transaction of its own, rolled back), and returns what was done.
    pub async fn shutdown(mut self) -> Result<RuntimeSummary> {
        let _ = self.stop.send(true);
        let mut summary = RuntimeSummary::default();
        while let Some(done) = self.tasks.join_next().await {
            match done.map_err(|e| Error::invalid("runtime task", e.to_string()))? {
                Finished::Worker(c) => summary.workers += c,
                Finished::Notifier(c) => summary.notifications += c,
                Finished::Other => {}
            }
        }
        Ok(summary)
    }
}
