//! `pgonce serve` (HTTP API + background runtime), `pgonce worker` (runtime
//! only) and `pgonce rollout` (change the guard rollout without a restart).
//!
//! Configuration, lowest to highest precedence: the defaults documented on
//! [`ServeConfig`], a TOML file (`--config`), environment variables
//! (`PGONCE_<FIELD>` in upper case, e.g. `PGONCE_LISTEN`, and
//! `DATABASE_URL`), then command-line flags. Validated before anything
//! starts. Both commands migrate on start, install the Prometheus recorder,
//! and stop gracefully on Ctrl-C or SIGTERM: stop accepting, finish
//! in-flight requests, then [`Runtime::shutdown`]. `serve` has `/metrics`,
//! `/healthz` and `/readyz` beside the API; `worker` serves them alone on
//! `metrics_listen` when it is set.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, bail};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use pgonce::WorkerConfig;
use pgonce_incidents::api::{self, ApiConfig, ApiState};
use pgonce_incidents::runtime::{Runtime, RuntimeConfig, observations_queue};
use pgonce_incidents::{NotifierConfig, Service, ServiceConfig, SimulatedEvaluatorConfig};
use serde::Deserialize;
use sqlx::PgPool;

use crate::database::Database;

/// `pgonce serve` / `pgonce worker` flags.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file (keys: the fields of the config; see README).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on (serve only). Default 127.0.0.1:8080.
    #[arg(long)]
    listen: Option<SocketAddr>,
}

/// `pgonce rollout` flags.
#[derive(Debug, clap::Args)]
pub struct RolloutArgs {
    /// Percent of entities (0-100) whose incidents take the guarded write;
    /// without it, prints the current value.
    percent: Option<u8>,
    /// TOML configuration file, for its database_url.
    #[arg(long)]
    config: Option<PathBuf>,
}

/// The service's settings. Every field has a default; `database_url` must
/// come from somewhere (file, `DATABASE_URL` or `--database-url`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    /// Where the API listens. Default `127.0.0.1:8080`.
    pub listen: SocketAddr,
    /// The PostgreSQL to use. No default.
    pub database_url: Option<String>,
    /// Pool size. Default 16; at least 2.
    pub max_connections: u32,
    /// Admin token of the admin routes, at least 16 bytes. Default none
    /// (admin routes refuse everyone).
    pub admin_token: Option<String>,
    /// Largest request body, bytes. Default 65536.
    pub body_limit: usize,
    /// Longest `GET /v1/events?wait=`, seconds. Default 30.
    pub max_wait_secs: u64,
    /// Pipeline workers. Default 2; 0 runs no pipeline.
    pub workers: usize,
    /// Messages each worker handles at once. Default 4; at least 1.
    pub concurrency: usize,
    /// Visibility timeout of the observations queue, seconds. Default 30.
    pub visibility_timeout_secs: u64,
    /// Deliveries before an observation is dead-lettered. Default 5.
    pub max_receive_count: u32,
    /// Webhook the notifier POSTs to; no notifier without one. Default none.
    pub webhook_url: Option<String>,
    /// `pgonce worker` only: where to serve `/metrics`, `/healthz` and
    /// `/readyz` (`serve` has them on `listen`). Default none.
    pub metrics_listen: Option<SocketAddr>,
    /// The simulated evaluator: least latency (ms, default 200), extra
    /// jitter (ms, default 100), failure rate in [0, 1] (default 0).
    pub evaluator_latency_ms: u64,
    pub evaluator_jitter_ms: u64,
    pub evaluator_failure_rate: f64,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            database_url: None,
            max_connections: 16,
            admin_token: None,
            body_limit: 64 * 1024,
            max_wait_secs: 30,
            workers: 2,
            concurrency: 4,
            visibility_timeout_secs: 30,
            max_receive_count: 5,
            webhook_url: None,
            metrics_listen: None,
            evaluator_latency_ms: 200,
            evaluator_jitter_ms: 100,
            evaluator_failure_rate: 0.0,
        }
    }
}

/// Sets `slot` from the environment variable `name`, if set.
fn env_override<T: FromStr>(
    env: &impl Fn(&str) -> Option<String>,
    name: &str,
    slot: &mut T,
) -> anyhow::Result<()>
where
    T::Err: std::fmt::Display,
{
    if let Some(value) = env(name) {
        *slot = value
            .parse()
            .map_err(|e| anyhow::anyhow!("environment variable {name}={value:?}: {e}"))?;
    }
    Ok(())
}

/// Sets an optional `slot` from `name`, if set and not empty.
fn env_override_option<T: FromStr>(
    env: &impl Fn(&str) -> Option<String>,
    name: &str,
    slot: &mut Option<T>,
) -> anyhow::Result<()>
where
    T::Err: std::fmt::Display,
{
    if let Some(value) = env(name).filter(|v| !v.is_empty()) {
        let parsed = value
            .parse()
            .map_err(|e| anyhow::anyhow!("environment variable {name}={value:?}: {e}"))?;
        *slot = Some(parsed);
    }
    Ok(())
}

impl ServeConfig {
    /// The file's settings (or the defaults without one), then the
    /// environment's, as read by `env`.
    pub fn load(
        file: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<ServeConfig> {
        let mut config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                toml::from_str(&text).with_context(|| format!("in {}", path.display()))?
            }
            None => ServeConfig::default(),
        };
        env_override(&env, "PGONCE_LISTEN", &mut config.listen)?;
        env_override_option(&env, "DATABASE_URL", &mut config.database_url)?;
        env_override_option(&env, "PGONCE_DATABASE_URL", &mut config.database_url)?;
        env_override(&env, "PGONCE_MAX_CONNECTIONS", &mut config.max_connections)?;
        env_override_option(&env, "PGONCE_ADMIN_TOKEN", &mut config.admin_token)?;
        env_override(&env, "PGONCE_BODY_LIMIT", &mut config.body_limit)?;
        env_override(&env, "PGONCE_MAX_WAIT_SECS", &mut config.max_wait_secs)?;
        env_override(&env, "PGONCE_WORKERS", &mut config.workers)?;
        env_override(&env, "PGONCE_CONCURRENCY", &mut config.concurrency)?;
        env_override(
            &env,
            "PGONCE_VISIBILITY_TIMEOUT_SECS",
            &mut config.visibility_timeout_secs,
        )?;
        env_override(
            &env,
            "PGONCE_MAX_RECEIVE_COUNT",
            &mut config.max_receive_count,
        )?;
        env_override_option(&env, "PGONCE_WEBHOOK_URL", &mut config.webhook_url)?;
        env_override_option(&env, "PGONCE_METRICS_LISTEN", &mut config.metrics_listen)?;
        env_override(
            &env,
            "PGONCE_EVALUATOR_LATENCY_MS",
            &mut config.evaluator_latency_ms,
        )?;
        env_override(
            &env,
            "PGONCE_EVALUATOR_JITTER_MS",
            &mut config.evaluator_jitter_ms,
        )?;
        env_override(
            &env,
            "PGONCE_EVALUATOR_FAILURE_RATE",
            &mut config.evaluator_failure_rate,
        )?;
        Ok(config)
    }

    /// Checks what cannot work, naming the setting.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.database_url.as_deref().is_none_or(str::is_empty) {
            bail!("no database: set database_url in the config, DATABASE_URL, or --database-url");
        }
        if self.max_connections < 2 {
            bail!("max_connections must be at least 2");
        }
        if self.concurrency == 0 {
            bail!("concurrency must be at least 1");
        }
        if self.visibility_timeout_secs == 0 {
            bail!("visibility_timeout_secs must be at least 1");
        }
        if self.max_receive_count == 0 {
            bail!("max_receive_count must be at least 1");
        }
        if !(0.0..=1.0).contains(&self.evaluator_failure_rate) {
            bail!("evaluator_failure_rate must be in [0, 1]");
        }
        if let Some(url) = &self.webhook_url
            && !url.starts_with("http://")
            && !url.starts_with("https://")
        {
            bail!("webhook_url must be an http:// or https:// URL");
        }
        self.api_config()
            .validate()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(())
    }

    fn visibility(&self) -> Duration {
        Duration::from_secs(self.visibility_timeout_secs)
    }

    fn api_config(&self) -> ApiConfig {
        ApiConfig {
            admin_token: self.admin_token.clone(),
            body_limit: self.body_limit,
            max_wait: Duration::from_secs(self.max_wait_secs),
            ..ApiConfig::default()
        }
    }

    fn runtime_config(&self) -> RuntimeConfig {
        RuntimeConfig {
            workers: self.workers,
            // A message still being handled keeps its visibility: the
            // heartbeat extends it by a whole timeout every third of one
            // (a fixed 10 s heartbeat would let a shorter timeout run out
            // mid-evaluation and hand the message to a second worker).
            worker: WorkerConfig {
                concurrency: self.concurrency,
                visibility: Some(self.visibility()),
                heartbeat_interval: Some(self.visibility() / 3),
                heartbeat_extension: self.visibility(),
                ..WorkerConfig::default()
            },
            evaluator: SimulatedEvaluatorConfig {
                latency: Duration::from_millis(self.evaluator_latency_ms),
                jitter: Duration::from_millis(self.evaluator_jitter_ms),
                failure_rate: self.evaluator_failure_rate,
                ..SimulatedEvaluatorConfig::default()
            },
            notifier: self.webhook_url.clone().map(NotifierConfig::new),
            ..RuntimeConfig::default()
        }
    }
}

/// The configuration of a `serve`/`worker` run: file, environment, flags.
fn configure(args: &ServeArgs, database_url: Option<&str>) -> anyhow::Result<ServeConfig> {
    let mut config = ServeConfig::load(args.config.as_deref(), |k| std::env::var(k).ok())?;
    if let Some(url) = database_url {
        config.database_url = Some(url.to_owned());
    }
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    config.validate()?;
    Ok(config)
}

async fn connect(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let database = Database::open(url).await?;
    let pool = database.pool(max_connections).await?;
    pgonce_incidents::migrate(&pool)
        .await
        .with_context(|| format!("migrating {}", database.address()))?;
    Ok(pool)
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

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutting down: finishing in-flight work");
}

/// `pgonce serve` (`api: true`) or `pgonce worker`.
pub async fn run(args: &ServeArgs, database_url: Option<&str>, api: bool) -> anyhow::Result<()> {
    let config = configure(args, database_url)?;
    let metrics = install_metrics()?;
    let url = config.database_url.as_deref().expect("validated");
    let pool = connect(url, config.max_connections).await?;
    let service = Service::new(pool.clone(), ServiceConfig::default())?;
    let queue = observations_queue(&pool, config.visibility(), config.max_receive_count).await?;
    // Bind before any worker starts: a port in use stops `serve` with one
    // line and nothing received, rather than aborting workers mid-message.
    let bind = async |address: SocketAddr| {
        let bound = tokio::net::TcpListener::bind(address).await;
        bound.with_context(|| format!("listening on {address}"))
    };
    let (listener, operations) = match (api, config.metrics_listen) {
        (true, _) => (Some(bind(config.listen).await?), None),
        (false, Some(address)) => (None, Some(bind(address).await?)),
        (false, None) => (None, None),
    };
    let runtime = Runtime::start(&service, queue.clone(), config.runtime_config())?;
    let served = if let Some(listener) = listener {
        let state = ApiState::new(service, queue, Some(metrics), config.api_config())?;
        tracing::info!(listen = %config.listen, "pgonce serve: API and runtime started");
        eprintln!("pgonce: serving on http://{}", listener.local_addr()?);
        // The API's own server: header and body timeouts, JSON errors.
        api::serve(
            listener,
            api::router(state),
            &config.api_config(),
            shutdown_signal(),
        )
        .await
        .context("serving HTTP")
    } else if let Some(listener) = operations {
        let state = ApiState::new(service, queue, Some(metrics), config.api_config())?;
        tracing::info!("pgonce worker: runtime started");
        eprintln!(
            "pgonce: metrics on http://{}/metrics",
            listener.local_addr()?
        );
        api::serve(
            listener,
            api::operations_router(state),
            &config.api_config(),
            shutdown_signal(),
        )
        .await
        .context("serving metrics")
    } else {
        // The runtime holds its own handles; this one would keep the queue's
        // listener alive past shutdown.
        drop(queue);
        tracing::info!("pgonce worker: runtime started");
        shutdown_signal().await;
        Ok(())
    };
    let summary = runtime.shutdown().await?;
    eprintln!(
        "pgonce: stopped; pipeline {:?}; notifications {:?}",
        summary.workers, summary.notifications
    );
    served
}

/// `pgonce rollout [PERCENT]`: prints, or changes, the guard rollout.
pub async fn rollout(args: &RolloutArgs, database_url: Option<&str>) -> anyhow::Result<()> {
    let mut config = ServeConfig::load(args.config.as_deref(), |k| std::env::var(k).ok())?;
    if let Some(url) = database_url {
        config.database_url = Some(url.to_owned());
    }
    let url = config.database_url.as_deref().filter(|u| !u.is_empty()).context(
        "rollout needs a database: set database_url in --config, DATABASE_URL, or --database-url",
    )?;
    let pool = connect(url, 2).await?;
    let before = pgonce_incidents::store::rollout_percent(&pool).await?;
    match args.percent {
        None => println!("guard rollout: {before}%"),
        Some(percent) => {
            pgonce_incidents::store::set_rollout_percent(&pool, percent).await?;
            println!("guard rollout: {before}% -> {percent}%");
        }
    }
    pool.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn defaults_then_file_then_environment() {
        let none = ServeConfig::load(None, env(&[])).unwrap();
        assert_eq!(none, ServeConfig::default());
        assert_eq!(none.listen.to_string(), "127.0.0.1:8080");

        let f =
            file("listen = \"0.0.0.0:9000\"\nworkers = 5\ndatabase_url = \"postgres://file/db\"\n");
        let from_file = ServeConfig::load(Some(f.path()), env(&[])).unwrap();
        assert_eq!(from_file.listen.to_string(), "0.0.0.0:9000");
        assert_eq!(from_file.workers, 5);
        assert_eq!(from_file.concurrency, 4);

        let vars = env(&[
            ("PGONCE_WORKERS", "7"),
            ("DATABASE_URL", "postgres://env/db"),
            ("PGONCE_ADMIN_TOKEN", "0123456789abcdef"),
        ]);
        let both = ServeConfig::load(Some(f.path()), vars).unwrap();
        assert_eq!(both.workers, 7);
        assert_eq!(both.listen.to_string(), "0.0.0.0:9000");
        assert_eq!(both.database_url.as_deref(), Some("postgres://env/db"));
        both.validate().unwrap();

        // PGONCE_DATABASE_URL, like every other key, and over DATABASE_URL.
        let vars = env(&[
            ("DATABASE_URL", "postgres://env/db"),
            ("PGONCE_DATABASE_URL", "postgres://pgonce/db"),
        ]);
        let url = ServeConfig::load(None, vars).unwrap().database_url;
        assert_eq!(url.as_deref(), Some("postgres://pgonce/db"));
    }

    #[test]
    fn a_short_visibility_timeout_gets_a_heartbeat_inside_it() {
        for secs in [1, 3, 30] {
            let config = ServeConfig {
                database_url: Some("postgres://x/y".into()),
                visibility_timeout_secs: secs,
                ..ServeConfig::default()
            };
            config.validate().unwrap();
            let worker = config.runtime_config().worker;
            worker.validate().unwrap();
            let visibility = Duration::from_secs(secs);
            assert!(worker.heartbeat_interval.unwrap() < visibility, "{secs} s");
            assert_eq!(worker.heartbeat_extension, visibility);
        }
    }

    #[test]
    fn bad_configuration_is_refused_with_the_setting_named() {
        let f = file("wokers = 3\n");
        let e = ServeConfig::load(Some(f.path()), env(&[])).unwrap_err();
        assert!(format!("{e:#}").contains("wokers"), "{e:#}");
        let f = file("workers = \"many\"\n");
        assert!(ServeConfig::load(Some(f.path()), env(&[])).is_err());
        let e = ServeConfig::load(None, env(&[("PGONCE_LISTEN", "nowhere")])).unwrap_err();
        assert!(e.to_string().contains("PGONCE_LISTEN"), "{e}");

        let ok = ServeConfig {
            database_url: Some("postgres://x/y".into()),
            ..ServeConfig::default()
        };
        ok.validate().unwrap();
        for (bad, needle) in [
            (ServeConfig::default(), "database"),
            (
                ServeConfig {
                    max_connections: 1,
                    ..ok.clone()
                },
                "max_connections",
            ),
            (
                ServeConfig {
                    concurrency: 0,
                    ..ok.clone()
                },
                "concurrency",
            ),
            (
                ServeConfig {
                    evaluator_failure_rate: 2.0,
                    ..ok.clone()
                },
                "failure_rate",
            ),
            (
                ServeConfig {
                    webhook_url: Some("ftp://x".into()),
                    ..ok.clone()
                },
                "webhook_url",
            ),
            (
                ServeConfig {
                    admin_token: Some("short".into()),
                    ..ok.clone()
                },
                "admin token",
            ),
            (
                ServeConfig {
                    body_limit: 10,
                    ..ok.clone()
                },
                "body limit",
            ),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{needle}: {e}");
        }
    }
}
