//! `pgonce serve` (HTTP API + background runtime), `pgonce worker` (runtime
//! only), `pgonce rollout` (change the guard rollout without a restart) and
//! `pgonce migrate` (the library's schema), on one configuration.
//!
//! The configuration is [`pgonce_incidents::config::Config`]: defaults, a
//! TOML file (`--config`), the environment (`PGONCE_...`, `DATABASE_URL`);
//! the command-line flags here come last. Validated before anything
//! starts. Both commands bind their listener first (`serve`'s API,
//! `worker`'s `api.metrics_listen` when set) and open the SQS queue with
//! `[queue] backend = "sqs"` (the Prometheus recorder installed in
//! between), so that an address in use or a queue out of reach stops them
//! before they touch the database; then they migrate (over
//! `database.direct_url` when set), run, and stop gracefully on Ctrl-C or
//! SIGTERM: stop accepting and finish in-flight requests (long polls of the event feed end at once, with an empty
//! page) while [`Runtime::shutdown`] stops the workers, which receive
//! nothing after the signal. A signal while they start, or a second one while
//! they drain, stops them at once ([`crate::stop`]). The observations queue is `[queue] backend`'s:
//! the PostgreSQL queue in the same database, or Amazon SQS. `serve` has `/metrics`, `/healthz` and `/readyz`
//! beside the API; `worker` serves them alone on `api.metrics_listen` when
//! it is set.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use pgonce::Queue;
use pgonce::maintenance::Maintenance;
use pgonce_incidents::Service;
use pgonce_incidents::api::{self, ApiState};
use pgonce_incidents::config::{Config, ConfigError, QueueBackend};
use pgonce_incidents::runtime::{
    Runtime, Unfinished, observations_queue_with, sqs_observations_queue,
};
use pgonce_sqs::{SqsClient, SqsQueue};
use sqlx::PgPool;

use crate::database::Database;
use crate::stop::ServiceStop;

/// `pgonce worker` flags, which `serve` has too.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// TOML configuration file (keys: docs/configuration.md).
    #[arg(long)]
    config: Option<PathBuf>,
}

/// `pgonce serve` flags: `worker`'s and `--listen`, which `worker` refuses
/// (it serves no API; its metrics listen on `api.metrics_listen`) rather
/// than take and ignore.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    worker: WorkerArgs,
    /// Address to listen on, over `api.listen`. Default 127.0.0.1:8080.
    #[arg(long)]
    listen: Option<SocketAddr>,
}

/// `pgonce migrate` flags.
#[derive(Debug, clap::Args)]
pub struct MigrateArgs {
    /// TOML configuration file: the one `serve` reads, checked as `serve`
    /// checks it; its `[database]` section is used.
    #[arg(long)]
    config: Option<PathBuf>,
}

/// `pgonce rollout` flags.
#[derive(Debug, clap::Args)]
pub struct RolloutArgs {
    /// Percent of entities (0-100) whose incidents take the guarded write
    /// (migrates first, as `serve` does); without it, prints the current
    /// value, only reading (no migration, a read-only transaction).
    #[arg(value_parser = clap::value_parser!(u8).range(0..=100))]
    percent: Option<u8>,
    /// TOML configuration file: the one `serve` reads, checked as `serve`
    /// checks it; its `[database]` section is used.
    #[arg(long)]
    config: Option<PathBuf>,
}

/// The process's environment, for [`Config::load`]. A variable whose name
/// or value is not UTF-8 is left out (`std::env::vars` would panic on it),
/// unless it is one the service reads: then it is refused, named.
fn environment() -> anyhow::Result<Vec<(String, String)>> {
    let mut vars = Vec::new();
    for (name, value) in std::env::vars_os() {
        match (name.into_string(), value.into_string()) {
            (Ok(name), Ok(value)) => vars.push((name, value)),
            (Ok(name), Err(_)) if name.starts_with("PGONCE_") || name == "DATABASE_URL" => {
                anyhow::bail!("{name}: not UTF-8")
            }
            _ => {}
        }
    }
    Ok(vars)
}

/// The configuration of a `serve`, `worker` or `rollout` run: file,
/// environment, flags, then checked whole, so that every command refuses a
/// bad value the same way, naming its key, before it connects.
/// `database_url` is the `--database-url` flag, when given on the command
/// line: it sets `database.url` and sets `database.direct_url` aside;
/// `listen`, `--listen`.
fn configure(
    file: Option<&Path>,
    database_url: Option<&str>,
    listen: Option<SocketAddr>,
) -> anyhow::Result<Config> {
    let mut config = Config::load(file, environment()?)?;
    if let Some(url) = database_url {
        config.database.url = Some(url.to_owned());
    }
    if let Some(listen) = listen {
        config.api.listen = listen;
    }
    config.validate()?;
    if database_url.is_some() {
        // The database typed on the command line is the one to use, for
        // every session: a direct URL the file or the environment holds
        // (checked above all the same) reaches the configured database,
        // most likely another one.
        config.database.direct_url = None;
    }
    Ok(config)
}

/// Runs `migrations` (given a pool of one connection) over the direct URL
/// when one is configured, else `database.url`, and returns the address it
/// migrated. Migrations keep no session state (each takes its lock for its
/// own transaction), so the pooled URL works as well; the direct one keeps
/// a long migration off the connections the pooler shares with live
/// traffic.
async fn migrate_with<F>(config: &Config, migrations: F) -> anyhow::Result<String>
where
    F: AsyncFnOnce(&PgPool) -> Result<(), sqlx::migrate::MigrateError>,
{
    let (key, direct) = config.direct_database().context("no database.url")?;
    let migrating = Database::open(direct, config.database.acquire_timeout)
        .await
        .context(key)?;
    let pool = migrating
        .pool(1, config.database.acquire_timeout)
        .await
        .context(key)?;
    migrations(&pool)
        .await
        .map_err(pgonce::Error::from)
        .with_context(|| format!("migrating {}", migrating.address()))?;
    pool.close().await;
    Ok(migrating.address())
}

/// The pool on `database.url`, after the service's migrations
/// ([`migrate_with`]).
async fn connect(config: &Config) -> anyhow::Result<PgPool> {
    let url = config.database.url.as_deref().context("no database.url")?;
    migrate_with(config, pgonce_incidents::migrate).await?;
    let database = Database::open(url, config.database.acquire_timeout)
        .await
        .context(URL_KEY)?;
    database
        .pool(
            config.database.max_connections,
            config.database.acquire_timeout,
        )
        .await
        .context(URL_KEY)
}

/// The key of `database.url`, which a failure to connect to it names
/// (`direct_url` may be set beside it).
const URL_KEY: &str = "database.url";

/// `pgonce migrate`: the library's migrations (the `pgonce` schema), on
/// the database of the configuration `serve` reads, over
/// `database.direct_url` when it is set, as `serve` migrates. The
/// configuration is checked whole first, as `serve` checks it, so that a
/// value `serve` would refuse stops `migrate` too, named, with nothing
/// applied.
pub async fn migrate(args: &MigrateArgs, database_url: Option<&str>) -> anyhow::Result<()> {
    let config = configure(args.config.as_deref(), database_url, None)?;
    let address = migrate_with(&config, pgonce::migrate).await?;
    eprintln!("pgonce: migrations applied to {address}");
    Ok(())
}

/// Installs the process-wide Prometheus recorder, and a task that keeps its
/// histograms trimmed.
fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// Resolves on the signal that drains the service (its first once it
/// runs; a second stops it at once, see [`crate::stop`]).
pub async fn shutdown_signal(stop: &ServiceStop) {
    let signal = stop.drain_requested().await;
    tracing::info!(
        signal = signal.signal,
        "shutting down: finishing in-flight work (a second signal stops at once)"
    );
}

/// `pgonce serve`: the HTTP API and the runtime.
pub async fn serve(
    args: &ServeArgs,
    database_url: Option<&str>,
    stop: &ServiceStop,
) -> anyhow::Result<()> {
    let file = args.worker.config.as_deref();
    run(file, args.listen, database_url, true, stop).await
}

/// `pgonce worker`: the runtime only.
pub async fn worker(
    args: &WorkerArgs,
    database_url: Option<&str>,
    stop: &ServiceStop,
) -> anyhow::Result<()> {
    run(args.config.as_deref(), None, database_url, false, stop).await
}

/// `pgonce serve` (`api: true`) or `pgonce worker`, configured from `file`,
/// the environment, then `listen` and `database_url`.
/// Until it runs, `stop`'s signals stop it at once; then the first drains.
async fn run(
    file: Option<&Path>,
    listen: Option<SocketAddr>,
    database_url: Option<&str>,
    api: bool,
    stop: &ServiceStop,
) -> anyhow::Result<()> {
    let config = configure(file, database_url, listen)?;
    if !api {
        check_worker_has_work(&config)?;
    }
    let listeners = Listeners::bind(&config, api).await?;
    let metrics = install_metrics()?;
    // The SQS queue is opened before the database is touched, as the
    // listener is bound: a queue misnamed or out of reach stops the
    // command with the database as it was.
    let sqs = match config.queue.backend {
        QueueBackend::Sqs => Some(open_sqs(&config).await?),
        QueueBackend::Postgres => None,
    };
    let pool = connect(&config).await?;
    let service = Service::new(pool.clone(), config.service_config())?;
    match sqs {
        Some(queue) => run_on(&config, listeners, metrics, pool, service, queue, stop).await,
        None => {
            let queue = observations_queue_with(
                &pool,
                config.pipeline.visibility_timeout,
                config.pipeline.max_receive_count,
                config.queue_options(),
            )
            .await?;
            run_on(&config, listeners, metrics, pool, service, queue, stop).await
        }
    }
}

/// The observations queue on SQS, as `[queue.sqs]` names it (created when
/// missing, with `create`).
async fn open_sqs(config: &Config) -> anyhow::Result<SqsQueue> {
    let section = &config.queue.sqs;
    let sqs = SqsClient::connect(section.sqs_config()).await?;
    let queue = sqs_observations_queue(
        &sqs,
        section,
        config.pipeline.visibility_timeout,
        config.pipeline.max_receive_count,
    )
    .await
    .with_context(|| format!("opening the SQS queue {}", section.queue_name()))?;
    tracing::info!(queue = %queue.url(), "observations on Amazon SQS");
    Ok(queue)
}

/// What `serve` or `worker` listens on, bound before it migrates or
/// starts any worker: an address in use stops it with one line, the
/// database untouched and nothing received. Connections made to it while
/// it migrates wait in the listen backlog and are answered once it serves.
struct Listeners {
    /// `serve`'s API (`api.listen`).
    api: Option<tokio::net::TcpListener>,
    /// `worker`'s metrics and readiness (`api.metrics_listen`, when set).
    operations: Option<tokio::net::TcpListener>,
}

impl Listeners {
    /// Binds `serve`'s (`api: true`) or `worker`'s listener.
    async fn bind(config: &Config, api: bool) -> anyhow::Result<Listeners> {
        let bind = async |address: SocketAddr| {
            let bound = tokio::net::TcpListener::bind(address).await;
            bound.with_context(|| format!("listening on {address}"))
        };
        Ok(match (api, config.api.metrics_listen) {
            (true, _) => Listeners {
                api: Some(bind(config.api.listen).await?),
                operations: None,
            },
            (false, Some(address)) => Listeners {
                api: None,
                operations: Some(bind(address).await?),
            },
            (false, None) => Listeners {
                api: None,
                operations: None,
            },
        })
    }
}

/// `pipeline.workers = 0` runs no pipeline worker: `serve` then answers
/// the API alone, and a `worker` runs only its other work (the notifier,
/// job maintenance, the cleaner), which it says. A `worker` left with no
/// work at all would idle silently: it is refused, before it connects.
fn check_worker_has_work(config: &Config) -> anyhow::Result<()> {
    if config.pipeline.workers > 0 {
        return Ok(());
    }
    let runs: Vec<&str> = [
        (config.notifier.webhook_url.is_some(), "the notifier"),
        (config.maintenance.enabled, "the job reaper and re-driver"),
        (config.maintenance.cleaner.enabled, "the cleaner"),
    ]
    .into_iter()
    .filter_map(|(on, what)| on.then_some(what))
    .collect();
    if runs.is_empty() {
        return Err(ConfigError::Invalid {
            key: "pipeline.workers",
            why: "0 and nothing else to run: `pgonce worker` would idle (set \
                  notifier.webhook_url, or enable maintenance or maintenance.cleaner)"
                .into(),
        }
        .into());
    }
    tracing::warn!(
        "pipeline.workers = 0: this worker takes no observations; it runs {}",
        runs.join(", ")
    );
    Ok(())
}

/// The rest of `serve`/`worker`, on either queue: the runtime, the API and
/// the pipeline are generic over [`Queue`] and behave the same on both.
async fn run_on<Q>(
    config: &Config,
    listeners: Listeners,
    metrics: PrometheusHandle,
    pool: PgPool,
    service: Service,
    queue: Q,
    stop: &ServiceStop,
) -> anyhow::Result<()>
where
    Q: Queue + Clone + 'static,
{
    let runtime = Runtime::start(&service, queue.clone(), config.runtime_config())?;
    let cleaner = &config.maintenance.cleaner;
    let maintenance = if cleaner.enabled {
        Some(Maintenance::spawn(
            pool.clone(),
            cleaner.maintenance_config(),
        )?)
    } else {
        None
    };
    // Taking work from here on: a signal drains rather than abandons it.
    stop.running();
    // The runtime stops at the signal, beside the API's drain, not after
    // it: waiting for the API's last answer first, its workers went on
    // receiving and handling observations after the signal, for as long as
    // a request under way took.
    let progress = runtime.progress();
    let cleaner_stopping = AtomicBool::new(maintenance.is_some());
    let runtime_stopped = async {
        stop.drain_requested().await;
        if let Some(maintenance) = maintenance {
            maintenance.stop().await;
            cleaner_stopping.store(false, Ordering::Relaxed);
        }
        runtime.shutdown().await
    };
    // What `serve` and `worker` answer on their listener; none without one.
    // The runtime holds its own handles; the queue's here would keep the
    // queue's listener alive past shutdown.
    let state = if listeners.api.is_some() || listeners.operations.is_some() {
        Some(ApiState::new(
            service,
            queue,
            Some(metrics),
            config.api_config(),
        )?)
    } else {
        drop(queue);
        None
    };
    let requests = state.as_ref().map(ApiState::requests_under_way);
    let drained = async {
        tokio::join!(
            serve_until_signal(config, listeners, state, stop),
            runtime_stopped,
        )
    };
    // The drain is bounded: a request or a task that never ends would keep
    // the process for ever. Past the bound, what is still under way is
    // dropped as a crash drops it (a handler's message unacked, redelivered
    // after its visibility timeout; a claimed notification sent again
    // after its lease), and the process says what it abandoned.
    let timeout = config.shutdown_timeout();
    let bound = async {
        stop.drain_requested().await;
        tokio::time::sleep(timeout).await;
    };
    let (served, stopped) = tokio::select! {
        biased;
        done = drained => done,
        () = bound => {
            return Err(Abandoned {
                timeout,
                requests: requests.map_or(0, |r| r.count()),
                runtime: progress.unfinished(),
                cleaner: cleaner_stopping.load(Ordering::Relaxed),
            }
            .into());
        }
    };
    let summary = stopped?;
    eprintln!(
        "pgonce: stopped; pipeline {:?}; notifications {:?}",
        summary.workers, summary.notifications
    );
    served
}

/// A drain that `shutdown.timeout` ended: what was still under way, and
/// dropped.
#[derive(Debug)]
struct Abandoned {
    timeout: Duration,
    /// API requests without an answer.
    requests: usize,
    /// The runtime's tasks still stopping.
    runtime: Unfinished,
    /// Whether the cleaner was still stopping.
    cleaner: bool,
}

impl std::fmt::Display for Abandoned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        let mut parts = Vec::new();
        if self.requests > 0 {
            parts.push(plural(self.requests, "API request", "API requests") + " under way");
        }
        let r = &self.runtime;
        if r.pipeline_workers > 0 {
            parts.push(
                plural(r.pipeline_workers, "pipeline worker", "pipeline workers")
                    + " (their observations in hand come back after their visibility timeout)",
            );
        }
        if r.notifier {
            parts.push(
                "the notifier (its claimed notifications are sent again after their lease)".into(),
            );
        }
        if r.job_maintenance > 0 {
            parts.push(plural(
                r.job_maintenance,
                "job maintenance loop",
                "job maintenance loops",
            ));
        }
        if r.ledger_cleaner {
            parts.push("the ledger cleaner".into());
        }
        if self.cleaner {
            parts.push("the cleaner".into());
        }
        if parts.is_empty() {
            // Every part had finished but the API's connections, closing.
            parts.push("the API's connections still closing".into());
        }
        write!(
            f,
            "stopping took longer than shutdown.timeout ({:?}): stopped at once, abandoning {}",
            self.timeout,
            parts.join(", ")
        )
    }
}

impl std::error::Error for Abandoned {}

/// What `serve` or `worker` answers until the signal that drains it: the
/// API (`serve`), the metrics and readiness (`worker` with
/// `api.metrics_listen`), or nothing; then the requests under way,
/// answered. `state` is there when a listener is.
async fn serve_until_signal(
    config: &Config,
    listeners: Listeners,
    state: Option<ApiState>,
    stop: &ServiceStop,
) -> anyhow::Result<()> {
    match (listeners, state) {
        (
            Listeners {
                api: Some(listener),
                ..
            },
            Some(state),
        ) => {
            tracing::info!(listen = %config.api.listen, "pgonce serve: API and runtime started");
            eprintln!("pgonce: serving on http://{}", listener.local_addr()?);
            // Long polls end with the signal: the drain waits for every
            // answer under way.
            let stopping = state.clone();
            let drain = async move {
                shutdown_signal(stop).await;
                stopping.stop_long_polls();
            };
            // The API's own server: header, body and write timeouts, JSON
            // errors.
            api::serve(listener, api::router(state), &config.api_config(), drain)
                .await
                .context("serving HTTP")
        }
        (
            Listeners {
                operations: Some(listener),
                ..
            },
            Some(state),
        ) => {
            tracing::info!("pgonce worker: runtime started");
            eprintln!(
                "pgonce: metrics on http://{}/metrics",
                listener.local_addr()?
            );
            api::serve(
                listener,
                api::operations_router(state),
                &config.api_config(),
                shutdown_signal(stop),
            )
            .await
            .context("serving metrics")
        }
        _ => {
            tracing::info!("pgonce worker: runtime started");
            shutdown_signal(stop).await;
            Ok(())
        }
    }
}

/// `pgonce rollout [PERCENT]`: prints, or changes, the guard rollout.
///
/// Printing only reads: no migration, and the read in a read-only
/// transaction, so it works on a standby or as a role that may not write,
/// and a build newer than the deployment's changes nothing by looking. A
/// database without the service's schema is named as not migrated rather
/// than read as the default. Setting migrates first, as `serve` does: a
/// deployment may set its rollout before its first `serve` starts.
pub async fn rollout(args: &RolloutArgs, database_url: Option<&str>) -> anyhow::Result<()> {
    // A value `serve` would refuse (a zero acquire timeout, a direct URL
    // that is not one) is refused here too, named, rather than met as a
    // failure to connect.
    let mut config = configure(args.config.as_deref(), database_url, None)?;
    config.database.max_connections = 2;
    let Some(percent) = args.percent else {
        let url = config.database.url.as_deref().context("no database.url")?;
        let database = Database::open(url, config.database.acquire_timeout)
            .await
            .context(URL_KEY)?;
        let pool = database
            .pool(1, config.database.acquire_timeout)
            .await
            .context(URL_KEY)?;
        let current = read_rollout(&pool)
            .await
            .with_context(|| format!("reading the guard rollout of {}", database.address()))?;
        pool.close().await;
        println!("guard rollout: {current}%");
        return Ok(());
    };
    let pool = connect(&config).await?;
    let before = pgonce_incidents::store::rollout_percent(&pool).await?;
    pgonce_incidents::store::set_rollout_percent(&pool, percent).await?;
    println!("guard rollout: {before}% -> {percent}%");
    pool.close().await;
    Ok(())
}

/// The guard rollout, read in a read-only transaction; an error naming the
/// missing table when the service's schema is not there.
async fn read_rollout(pool: &PgPool) -> anyhow::Result<u8> {
    let mut read = pool.begin().await.map_err(pgonce::Error::from)?;
    sqlx::query("SET TRANSACTION READ ONLY")
        .execute(&mut *read)
        .await
        .map_err(pgonce::Error::from)?;
    let migrated: bool = sqlx::query_scalar("SELECT to_regclass('incidents.settings') IS NOT NULL")
        .fetch_one(&mut *read)
        .await
        .map_err(pgonce::Error::from)?;
    anyhow::ensure!(
        migrated,
        "not migrated: no table incidents.settings (`pgonce serve`, `pgonce worker` and \
         `pgonce rollout PERCENT` migrate it)"
    );
    // What this build reads is what its migrations made: a newer build's
    // schema may keep the setting elsewhere, or mean another thing by it.
    if let Some(version) = pgonce_incidents::newer_version(&mut read)
        .await
        .map_err(pgonce::Error::from)?
    {
        anyhow::bail!(
            "a newer build migrated the database (migration {version}): read the rollout \
             with that build's `pgonce rollout`"
        );
    }
    let percent = pgonce_incidents::store::rollout_percent(&mut *read).await?;
    read.rollback().await.map_err(pgonce::Error::from)?;
    Ok(percent)
}
