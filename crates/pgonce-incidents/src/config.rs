//! The service's deployable configuration: one [`Config`] in nested
//! sections (`database`, `queue`, `api`, `pipeline`, `notifier`, `service`,
//! `maintenance`, `shutdown`), loaded in layers, lowest to highest precedence:
//!
//! 1. the defaults documented on each field;
//! 2. a TOML file, when one is named;
//! 3. environment variables: `PGONCE_` then the key path in upper case with
//!    `__` between sections, e.g. `PGONCE_API__LISTEN`,
//!    `PGONCE_PIPELINE__EVALUATOR__LATENCY`; `DATABASE_URL` for
//!    `database.url` (`PGONCE_DATABASE__URL` wins over it). The flat names of
//!    earlier versions (`PGONCE_LISTEN`, `PGONCE_WORKERS`,
//!    `PGONCE_MAX_WAIT_SECS`, ...) still work: see [`LEGACY_ENV`]. An empty
//!    variable counts as unset.
//!
//! Durations are human: `"30s"`, `"5m"`, `"250ms"`. A key no section has,
//! in the file or the environment, is refused with the key named; so is a
//! value of the wrong type. [`Config::validate`] then checks what cannot
//! work, naming the key. docs/configuration.md lists every key.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use figment::providers::{Data, Format, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use pgonce::job::{ReaperConfig, RedriverConfig, RetryPolicy};
use pgonce::maintenance::MaintenanceConfig;
use pgonce::{Listen, PgQueueOptions, WorkerConfig};
use serde::Deserialize;
use sqlx::postgres::PgConnectOptions;

mod queue;

pub use queue::{QueueBackend, QueueSection, SqsSection};

use crate::api::ApiConfig;
use crate::notifier::NotifierConfig;
use crate::pipeline::{LedgerCleanerConfig, SimulatedEvaluatorConfig};
use crate::runtime::RuntimeConfig;
use crate::service::ServiceConfig;

/// Why a configuration was refused. Each message names the key (or the
/// file) at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The named file could not be read.
    #[error("configuration file {path}: {reason}")]
    File {
        /// The file, as given.
        path: PathBuf,
        /// Why it could not be read.
        reason: String,
    },
    /// A key unknown, or a value of the wrong type, in the file or the
    /// environment. The message names the key and where it came from.
    #[error("{0}")]
    Load(String),
    /// A value of the right type that cannot work.
    #[error("{key}: {why}")]
    Invalid {
        /// The key at fault (`pipeline.visibility_timeout`).
        key: &'static str,
        /// Why its value cannot work.
        why: String,
    },
}

/// The most worker loops one process runs (each has its own receives and
/// handler slots, so an unbounded count could exhaust memory).
const MAX_WORKERS: usize = 1024;

/// The largest pool: PostgreSQL's own ceiling on its `max_connections`,
/// past which no server accepts a connection. The pool sets aside a slot
/// for every connection it may hold as it is built, so a pool of
/// `u32::MAX` asked for room for four billion connections at start.
const MAX_CONNECTIONS: u32 = 262_143;

/// The longest timeout, wait, interval or delay a setting takes.
const LONGEST_SETTING: Duration = Duration::from_secs(365 * 24 * 3600);

fn invalid(key: &'static str, why: impl ToString) -> ConfigError {
    ConfigError::Invalid {
        key,
        why: why.to_string(),
    }
}

/// Everything `pgonce serve` and `pgonce worker` can be told.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[database]`.
    pub database: DatabaseSection,
    /// `[queue]`.
    pub queue: QueueSection,
    /// `[api]`.
    pub api: ApiSection,
    /// `[pipeline]`.
    pub pipeline: PipelineSection,
    /// `[notifier]`.
    pub notifier: NotifierSection,
    /// `[service]`.
    pub service: ServiceSection,
    /// `[maintenance]`.
    pub maintenance: MaintenanceSection,
    /// `[shutdown]`.
    pub shutdown: ShutdownSection,
}

/// `[shutdown]`: how long `serve` and `worker` take to stop.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownSection {
    /// `timeout`: from the first SIGTERM or Ctrl-C, how long the process
    /// drains (the API's requests under way, the pipeline's handlers
    /// within `pipeline.shutdown_deadline` and their acks and hand-backs,
    /// the notifier's pass, the cleaner) before it stops at once, exit 1,
    /// naming what it abandoned. Longer than `pipeline.shutdown_deadline`
    /// plus 5 s; default that deadline plus 30 s ([`Config::shutdown_timeout`]).
    #[serde(with = "humantime_serde")]
    pub timeout: Option<Duration>,
}

/// What a stop's pipeline part takes past `pipeline.shutdown_deadline` at
/// most: the acks and hand-backs' grace ([`WorkerConfig::shutdown_deadline`]).
const PIPELINE_GRACE: Duration = Duration::from_secs(5);

/// `shutdown.timeout` when unset: this past `pipeline.shutdown_deadline`.
const SHUTDOWN_MARGIN: Duration = Duration::from_secs(30);

/// `[database]`: where PostgreSQL is and how the pool behaves.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseSection {
    /// `url`: the PostgreSQL to use, e.g. `postgres://user@host/db`. No
    /// default: it must come from somewhere.
    pub url: Option<String>,
    /// `direct_url`: a URL that reaches PostgreSQL itself, for the
    /// session that needs one: the queue's LISTEN. Set it when `url` goes
    /// through a transaction-mode pooler (PgBouncer), where LISTEN does not
    /// work. The migrations run over it too, which keeps a long one off
    /// the connections the pooler shares, though they work through the
    /// pooler as well (each takes its lock inside its own transaction).
    /// Default: none (`url` for everything).
    pub direct_url: Option<String>,
    /// `max_connections`: pool size. Default 16; at least 2, at most
    /// 262143 (PostgreSQL's own ceiling).
    pub max_connections: u32,
    /// `acquire_timeout`: longest wait for a pooled connection (including
    /// opening one) before a request fails with 503 `unavailable`. Default
    /// 5s; at least 1ms.
    #[serde(with = "humantime_serde")]
    pub acquire_timeout: Duration,
    /// `listen`: wake long-polling queue receivers by LISTEN/NOTIFY.
    /// Default true. `false`: no LISTEN connection at all; receivers find
    /// new messages by polling every `pipeline.poll_interval`.
    pub listen: bool,
}

impl Default for DatabaseSection {
    fn default() -> Self {
        DatabaseSection {
            url: None,
            direct_url: None,
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            listen: true,
        }
    }
}

/// `[api]`: the HTTP side.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiSection {
    /// `listen`: where `serve` listens. Default `127.0.0.1:8080`.
    pub listen: SocketAddr,
    /// `metrics_listen`: where `worker` serves `/metrics`, `/healthz` and
    /// `/readyz` (`serve` has them on `listen`). Default none.
    pub metrics_listen: Option<SocketAddr>,
    /// `admin_token`: the admin routes' bearer token, at least 16 bytes.
    /// Default none (admin routes refuse everyone).
    pub admin_token: Option<String>,
    /// `body_limit`: largest request body, bytes. Default 65536; 1024 to
    /// 16777216 ([`crate::api::MAX_BODY_LIMIT`]).
    pub body_limit: usize,
    /// `max_wait`: longest `GET /v1/events?wait=`. Default 30s.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// `header_timeout`: a connection that has not sent a request's whole
    /// head within this is closed. Default 10s.
    #[serde(with = "humantime_serde")]
    pub header_timeout: Duration,
    /// `body_timeout`: a request whose body has not arrived within this
    /// gets 408. Default 10s.
    #[serde(with = "humantime_serde")]
    pub body_timeout: Duration,
    /// `write_timeout`: a connection whose client has taken none of an
    /// answer's bytes for this long is closed. Default 10s.
    #[serde(with = "humantime_serde")]
    pub write_timeout: Duration,
}

impl Default for ApiSection {
    fn default() -> Self {
        let api = ApiConfig::default();
        ApiSection {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            metrics_listen: None,
            admin_token: api.admin_token,
            body_limit: api.body_limit,
            max_wait: api.max_wait,
            header_timeout: api.header_timeout,
            body_timeout: api.body_timeout,
            write_timeout: api.write_timeout,
        }
    }
}

/// `[pipeline]`: the workers on the observations queue.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineSection {
    /// `workers`: pipeline workers in this process. Default 2; 0 runs none;
    /// at most 1024.
    pub workers: usize,
    /// `concurrency`: messages each worker handles at once. Default 4; at
    /// least 1.
    pub concurrency: usize,
    /// `batch`: messages asked for per receive. Default 10; 1 to 1000.
    pub batch: usize,
    /// `wait`: long-poll wait of each receive. Default 5s; above zero (an
    /// idle worker receives once per wait).
    #[serde(with = "humantime_serde")]
    pub wait: Duration,
    /// `poll_interval`: a long poll re-checks the queue at least this often
    /// (the only wake-up when `database.listen` is false). Default 1s.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// `visibility_timeout`: how long a received message stays invisible;
    /// workers heartbeat every third of it. Default 30s; at least 1s.
    #[serde(with = "humantime_serde")]
    pub visibility_timeout: Duration,
    /// `max_receive_count`: deliveries before an observation is
    /// dead-lettered. Default 5; 1 to 2147483647 (1000 on SQS).
    pub max_receive_count: u32,
    /// `failure_visibility`: after a failed handler, the message is visible
    /// again after this long. Default none (the visibility timeout).
    #[serde(with = "humantime_serde")]
    pub failure_visibility: Option<Duration>,
    /// `shutdown_deadline`: how long shutdown waits for in-flight handlers;
    /// acks and hand-backs then get 5 s more
    /// ([`WorkerConfig::shutdown_deadline`]). Default 30s.
    #[serde(with = "humantime_serde")]
    pub shutdown_deadline: Duration,
    /// `[pipeline.evaluator]`: the simulated policy evaluator.
    pub evaluator: EvaluatorSection,
}

impl Default for PipelineSection {
    fn default() -> Self {
        let worker = WorkerConfig::default();
        PipelineSection {
            workers: 2,
            concurrency: 4,
            batch: worker.batch,
            wait: worker.wait,
            poll_interval: PgQueueOptions::default().poll_interval,
            visibility_timeout: Duration::from_secs(30),
            max_receive_count: 5,
            failure_visibility: worker.failure_visibility,
            shutdown_deadline: worker.shutdown_deadline,
            evaluator: EvaluatorSection::default(),
        }
    }
}

/// `[pipeline.evaluator]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvaluatorSection {
    /// `latency`: least time one evaluation takes. Default 200ms.
    #[serde(with = "humantime_serde")]
    pub latency: Duration,
    /// `jitter`: extra time, uniform in [0, jitter). Default 100ms.
    #[serde(with = "humantime_serde")]
    pub jitter: Duration,
    /// `failure_rate`: share of evaluations that fail, in [0, 1]. Default 0.
    pub failure_rate: f64,
    /// `slow_rate`: share of evaluations that take `slow_latency`, in
    /// [0, 1]. Default 0.
    pub slow_rate: f64,
    /// `slow_latency`. Default 1s.
    #[serde(with = "humantime_serde")]
    pub slow_latency: Duration,
}

impl Default for EvaluatorSection {
    fn default() -> Self {
        let e = SimulatedEvaluatorConfig::default();
        EvaluatorSection {
            latency: e.latency,
            jitter: e.jitter,
            failure_rate: e.failure_rate,
            slow_rate: e.slow_rate,
            slow_latency: e.slow_latency,
        }
    }
}

/// `[notifier]`: sends each incident's notification to a webhook.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NotifierSection {
    /// `webhook_url`: `http://` or `https://`; no notifier in this process
    /// without one. Default none.
    pub webhook_url: Option<String>,
    /// `batch`: jobs claimed per pass. Default 16; at least 1.
    pub batch: i64,
    /// `lease`: a claim not completed by then may be taken over. Default
    /// 30s; longer than `timeout`.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// `timeout`: of one POST. Default 5s.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// `idle`: pause when there was nothing to send. Default 100ms. After
    /// a failed pass the pause doubles with each failure in a row, up to
    /// 30 s ([`crate::NotifierConfig::idle`]).
    #[serde(with = "humantime_serde")]
    pub idle: Duration,
    /// `[notifier.retry]`: backoff of failed sends.
    pub retry: RetrySection,
}

impl Default for NotifierSection {
    fn default() -> Self {
        let n = NotifierConfig::new("");
        NotifierSection {
            webhook_url: None,
            batch: n.batch,
            lease: n.lease,
            timeout: n.timeout,
            idle: n.idle,
            retry: RetrySection::default(),
        }
    }
}

/// `[notifier.retry]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetrySection {
    /// `base`: delay after the first failure. Default 1s; at least 1ms.
    #[serde(with = "humantime_serde")]
    pub base: Duration,
    /// `max`: upper bound of the delay before jitter. Default 10m.
    #[serde(with = "humantime_serde")]
    pub max: Duration,
    /// `jitter`: random extra fraction of the delay, in [0, 1]. Default 0.25.
    pub jitter: f64,
}

impl Default for RetrySection {
    fn default() -> Self {
        let r = RetryPolicy::default();
        RetrySection {
            base: r.base,
            max: r.max,
            jitter: r.jitter,
        }
    }
}

/// How incident numbers are serialized per organization.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Numbering {
    /// An advisory lock per organization (the default).
    #[default]
    AdvisoryLock,
    /// A counter row per organization.
    CounterRow,
    /// A table lock: correct, but every organization waits on it.
    TableLock,
}

impl From<Numbering> for pgonce::SequenceStrategy {
    fn from(n: Numbering) -> Self {
        match n {
            Numbering::AdvisoryLock => pgonce::SequenceStrategy::AdvisoryLock,
            Numbering::CounterRow => pgonce::SequenceStrategy::CounterRow,
            Numbering::TableLock => pgonce::SequenceStrategy::TableLock,
        }
    }
}

/// `[service]`: the incident service's own choices.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServiceSection {
    /// `numbering`: `advisory_lock` (default), `counter_row` or
    /// `table_lock`.
    pub numbering: Numbering,
    /// `entity_lock_timeout`: longest wait for an entity's lock (a guarded
    /// incident write's, `PUT /v1/entities/{id}/singleton`'s, then 503
    /// `busy`). Default 10s.
    #[serde(with = "humantime_serde")]
    pub entity_lock_timeout: Duration,
    /// `declaration_lock_timeout`: longest wait of a declaration for its
    /// idempotency key's lock, then 503 `busy`. Default 10s.
    #[serde(with = "humantime_serde")]
    pub declaration_lock_timeout: Duration,
    /// `notify_max_attempts`: attempts of a notification before it is
    /// dead. Default 8; at least 1.
    pub notify_max_attempts: i32,
}

impl Default for ServiceSection {
    fn default() -> Self {
        let s = ServiceConfig::default();
        ServiceSection {
            numbering: Numbering::default(),
            entity_lock_timeout: s.entity_lock_timeout,
            declaration_lock_timeout: s.declaration_lock_timeout,
            notify_max_attempts: s.notify_max_attempts,
        }
    }
}

/// `[maintenance]`: the job reaper and re-driver.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MaintenanceSection {
    /// `enabled`: run the reaper and the re-driver in this process.
    /// Default true.
    pub enabled: bool,
    /// `[maintenance.reaper]`: returns expired notification leases.
    pub reaper: PassSection,
    /// `[maintenance.redriver]`: makes failed notifications due again.
    pub redriver: PassSection,
    /// `[maintenance.cleaner]`: deletes what is past its retention.
    pub cleaner: CleanerSection,
}

/// `[maintenance.cleaner]`: how long finished rows are kept before the
/// maintenance loop deletes them in bounded batches
/// ([`pgonce::maintenance`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CleanerSection {
    /// `enabled`: run the cleaner in this process. Default true; several
    /// processes may run it at once.
    pub enabled: bool,
    /// `interval`: pause between passes. Default 1m.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// `batch_size`: rows deleted per statement. Default 1000; at least 1.
    pub batch_size: i64,
    /// `completed_jobs`: kept this long after they finished. Default 24h.
    #[serde(with = "humantime_serde")]
    pub completed_jobs: Duration,
    /// `dead_jobs`: kept this long after they died. Default 7days.
    #[serde(with = "humantime_serde")]
    pub dead_jobs: Duration,
    /// `queue_dedup`: deduplication claims, kept this long after their
    /// window ended. Default 0s.
    #[serde(with = "humantime_serde")]
    pub queue_dedup: Duration,
    /// `dead_letter_messages`: messages in a dead-letter queue, kept this
    /// long after they were sent. Default 14days.
    #[serde(with = "humantime_serde")]
    pub dead_letter_messages: Duration,
    /// `idempotency_keys`: kept this long after they were created (never
    /// while held). Default 24h.
    #[serde(with = "humantime_serde")]
    pub idempotency_keys: Duration,
    /// `processed_messages`: processed-message keys of
    /// [`pgonce::dedupe`] (`pgonce.processed_messages`), kept this long.
    /// Default 7days. The service writes none: the pipeline keeps its own
    /// ledger (`observations` below).
    #[serde(with = "humantime_serde")]
    pub processed_messages: Duration,
    /// `observations`: rows of the pipeline's ledger
    /// (`incidents.observations`), kept this long after their last
    /// delivery. Default none: kept for good. A producer's resend, or a
    /// redrive from the dead-letter queue, arriving after its row was
    /// deleted is processed again as a new observation
    /// ([`LedgerCleanerConfig`]). At least 28 days.
    #[serde(with = "humantime_serde")]
    pub observations: Option<Duration>,
    /// `keep`: kinds of rows never deleted, by the names above, e.g.
    /// `["dead_jobs"]`. Default none.
    pub keep: Vec<String>,
}

/// The kinds of rows `[maintenance.cleaner]` names.
const CLEANED: [&str; 7] = [
    "completed_jobs",
    "dead_jobs",
    "queue_dedup",
    "dead_letter_messages",
    "idempotency_keys",
    "processed_messages",
    "observations",
];

impl Default for CleanerSection {
    fn default() -> Self {
        let m = MaintenanceConfig::default();
        let or_zero = |d: Option<Duration>| d.unwrap_or_default();
        CleanerSection {
            enabled: true,
            interval: m.interval,
            batch_size: m.batch_size,
            completed_jobs: or_zero(m.completed_jobs),
            dead_jobs: or_zero(m.dead_jobs),
            queue_dedup: or_zero(m.queue_dedup),
            dead_letter_messages: or_zero(m.dead_letter_messages),
            idempotency_keys: or_zero(m.idempotency_keys),
            processed_messages: or_zero(m.processed_messages),
            observations: None,
            keep: Vec::new(),
        }
    }
}

impl CleanerSection {
    /// The library's configuration: `None` for the kinds in `keep`.
    pub fn maintenance_config(&self) -> MaintenanceConfig {
        let retain = |name: &str, d: Duration| (!self.keep.iter().any(|k| k == name)).then_some(d);
        MaintenanceConfig {
            interval: self.interval,
            batch_size: self.batch_size,
            completed_jobs: retain("completed_jobs", self.completed_jobs),
            dead_jobs: retain("dead_jobs", self.dead_jobs),
            queue_dedup: retain("queue_dedup", self.queue_dedup),
            dead_letter_messages: retain("dead_letter_messages", self.dead_letter_messages),
            idempotency_keys: retain("idempotency_keys", self.idempotency_keys),
            processed_messages: retain("processed_messages", self.processed_messages),
        }
    }

    /// The pipeline ledger's cleaner: `None` unless `enabled`, with
    /// `observations` set and not in `keep`.
    pub fn ledger_cleaner_config(&self) -> Option<LedgerCleanerConfig> {
        let kept = self.keep.iter().any(|k| k == "observations");
        let retention = self.observations.filter(|_| self.enabled && !kept)?;
        Some(LedgerCleanerConfig {
            retention,
            interval: self.interval,
            batch_size: self.batch_size,
        })
    }
}

impl Default for MaintenanceSection {
    fn default() -> Self {
        let reaper = ReaperConfig::default();
        let redriver = RedriverConfig::default();
        MaintenanceSection {
            enabled: true,
            reaper: PassSection {
                interval: reaper.interval,
                batch_size: reaper.batch_size,
            },
            redriver: PassSection {
                interval: redriver.interval,
                batch_size: redriver.batch_size,
            },
            cleaner: CleanerSection::default(),
        }
    }
}

/// A periodic pass: `[maintenance.reaper]` or `[maintenance.redriver]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PassSection {
    /// `interval`: pause between passes. Default 1s; non-zero.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// `batch_size`: jobs per statement. Default 1000; at least 1.
    pub batch_size: i64,
}

impl Default for PassSection {
    fn default() -> Self {
        MaintenanceSection::default().reaper
    }
}

/// An environment variable of an earlier version: a flat name standing
/// for one key. They keep working.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegacyVariable {
    /// The name after `PGONCE_` (`MAX_WAIT_SECS`).
    pub name: &'static str,
    /// The key it sets (`api.max_wait`).
    pub key: &'static str,
    /// The unit a bare number is in (`"s"`, `"ms"`), or `""` when the value
    /// is taken as it is.
    pub unit: &'static str,
}

/// Every [`LegacyVariable`].
pub const LEGACY_ENV: &[LegacyVariable] = &[
    LegacyVariable {
        name: "LISTEN",
        key: "api.listen",
        unit: "",
    },
    LegacyVariable {
        name: "METRICS_LISTEN",
        key: "api.metrics_listen",
        unit: "",
    },
    LegacyVariable {
        name: "ADMIN_TOKEN",
        key: "api.admin_token",
        unit: "",
    },
    LegacyVariable {
        name: "BODY_LIMIT",
        key: "api.body_limit",
        unit: "",
    },
    LegacyVariable {
        name: "MAX_WAIT_SECS",
        key: "api.max_wait",
        unit: "s",
    },
    LegacyVariable {
        name: "DATABASE_URL",
        key: "database.url",
        unit: "",
    },
    LegacyVariable {
        name: "MAX_CONNECTIONS",
        key: "database.max_connections",
        unit: "",
    },
    LegacyVariable {
        name: "WORKERS",
        key: "pipeline.workers",
        unit: "",
    },
    LegacyVariable {
        name: "CONCURRENCY",
        key: "pipeline.concurrency",
        unit: "",
    },
    LegacyVariable {
        name: "VISIBILITY_TIMEOUT_SECS",
        key: "pipeline.visibility_timeout",
        unit: "s",
    },
    LegacyVariable {
        name: "MAX_RECEIVE_COUNT",
        key: "pipeline.max_receive_count",
        unit: "",
    },
    LegacyVariable {
        name: "EVALUATOR_LATENCY_MS",
        key: "pipeline.evaluator.latency",
        unit: "ms",
    },
    LegacyVariable {
        name: "EVALUATOR_JITTER_MS",
        key: "pipeline.evaluator.jitter",
        unit: "ms",
    },
    LegacyVariable {
        name: "EVALUATOR_FAILURE_RATE",
        key: "pipeline.evaluator.failure_rate",
        unit: "",
    },
    LegacyVariable {
        name: "WEBHOOK_URL",
        key: "notifier.webhook_url",
        unit: "",
    },
];

/// Keys whose values stay text even when they look like numbers.
const TEXT_KEYS: &[&str] = &[
    "database.url",
    "database.direct_url",
    "api.admin_token",
    "notifier.webhook_url",
    "queue.sqs.queue",
    "queue.sqs.dead_letter_queue",
    "queue.sqs.region",
    "queue.sqs.endpoint_url",
];

/// The environment's layer: the variables given, as nested keys.
struct Environment {
    /// The keys the variables set, lowest precedence first.
    keys: Vec<EnvKey>,
}

/// One key a variable sets.
struct EnvKey {
    /// The variable (`PGONCE_API__LISTEN`), for errors.
    variable: String,
    /// The dotted key it sets (`api.listen`).
    key: String,
    value: Value,
}

impl Environment {
    fn new(vars: impl IntoIterator<Item = (String, String)>) -> Environment {
        let mut generic = Vec::new();
        let mut legacy = Vec::new();
        let mut plain = Vec::new();
        for (name, value) in vars {
            if value.is_empty() {
                continue;
            }
            if name == "DATABASE_URL" {
                plain.push((name, "database.url".to_owned(), value));
                continue;
            }
            let Some(rest) = name.strip_prefix("PGONCE_") else {
                continue;
            };
            match LEGACY_ENV.iter().find(|legacy| legacy.name == rest) {
                Some(&LegacyVariable { key, unit, .. }) => {
                    let value = if !unit.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
                        format!("{value}{unit}")
                    } else {
                        value
                    };
                    legacy.push((name.clone(), key.to_owned(), value));
                }
                None => {
                    let key = rest.to_ascii_lowercase().replace("__", ".");
                    generic.push((name.clone(), key, value));
                }
            }
        }
        // Lowest first: DATABASE_URL, the flat names, the nested names.
        let keys = plain
            .into_iter()
            .chain(legacy)
            .chain(generic)
            .map(|(variable, key, value)| {
                let value = if TEXT_KEYS.contains(&key.as_str()) {
                    Value::from(value)
                } else {
                    value.parse().unwrap_or_else(|e| match e {})
                };
                EnvKey {
                    variable,
                    key,
                    value,
                }
            })
            .collect();
        Environment { keys }
    }
}

/// The file's layer: figment's TOML provider on the file's text, whose
/// errors name the file and a key as the file writes it
/// (`database.max_connections`). figment's own put the profile before it
/// (`default.database.max_connections`), a key no file has.
struct FileLayer {
    /// The file, as given.
    path: PathBuf,
    /// Its text, parsed.
    toml: Data<Toml>,
}

impl Provider for FileLayer {
    fn metadata(&self) -> Metadata {
        Metadata::from("TOML file", self.path.as_path())
            .interpolater(|_: &Profile, path: &[&str]| path.join("."))
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        self.toml.data()
    }
}

/// Sets `path` (dotted) in `dict` to `value`, creating sections on the way.
fn insert(dict: &mut Dict, path: &str, value: Value) {
    match path.split_once('.') {
        None => {
            dict.insert(path.to_owned(), value);
        }
        Some((head, rest)) => {
            let entry = dict
                .entry(head.to_owned())
                .or_insert_with(|| Value::from(Dict::new()));
            if entry.as_dict().is_none() {
                *entry = Value::from(Dict::new());
            }
            if let Value::Dict(_, inner) = entry {
                insert(inner, rest, value);
            }
        }
    }
}

impl Provider for Environment {
    fn metadata(&self) -> Metadata {
        // Errors name the variable that set the key.
        let names: Arc<BTreeMap<String, String>> = Arc::new(
            self.keys
                .iter()
                .map(|k| (k.key.clone(), k.variable.clone()))
                .collect(),
        );
        Metadata::named("the environment").interpolater(move |_: &Profile, path: &[&str]| {
            let key = path.join(".");
            let prefixed =
                |k: &str| format!("PGONCE_{}", k.to_ascii_uppercase().replace('.', "__"));
            names.get(&key).cloned().unwrap_or_else(|| {
                // A section: the variables under it.
                let under: Vec<&str> = names
                    .iter()
                    .filter(|(k, _)| k.starts_with(&format!("{key}.")))
                    .map(|(_, n)| n.as_str())
                    .collect();
                if under.is_empty() {
                    prefixed(&key)
                } else {
                    under.join(", ")
                }
            })
        })
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let mut dict = Dict::new();
        for EnvKey { key, value, .. } in &self.keys {
            insert(&mut dict, key, value.clone());
        }
        Ok(Profile::Default.collect(dict))
    }
}

impl Config {
    /// The defaults, then `file` (TOML) when given, then the variables of
    /// `env` (the process's: `std::env::vars()`). Unknown keys and values
    /// of the wrong type are refused, naming them. Does not
    /// [`validate`](Config::validate).
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut figment = Figment::new();
        if let Some(path) = file {
            let metadata = std::fs::metadata(path).map_err(|e| ConfigError::File {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
            if !metadata.is_file() {
                return Err(ConfigError::File {
                    path: path.to_owned(),
                    reason: "not a file".into(),
                });
            }
            // Read here, so that a file that cannot be read (no read
            // permission, not UTF-8) is ConfigError::File naming it, as
            // one that is missing is; figment parses what was read.
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
            figment = figment.merge(FileLayer {
                path: path.to_owned(),
                toml: Toml::string(&text),
            });
        }
        figment = figment.merge(Environment::new(env));
        figment.extract().map_err(|e| {
            // One line per problem, each naming its key.
            let lines: Vec<String> = e.into_iter().map(|e| e.to_string()).collect();
            ConfigError::Load(lines.join("; "))
        })
    }

    /// Checks what cannot work, naming the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // Timeouts, waits, intervals and delays are added to clocks (an
        // `Instant`, a pool's deadline, `now()` in SQL): one long enough to
        // overflow them was accepted here and then panicked, or failed
        // every pass, at run time. (Retentions are the cleaner's, checked
        // with it below.)
        let p = &self.pipeline;
        let n = &self.notifier;
        let m = &self.maintenance;
        let settings = [
            ("database.acquire_timeout", self.database.acquire_timeout),
            ("api.max_wait", self.api.max_wait),
            ("api.header_timeout", self.api.header_timeout),
            ("api.body_timeout", self.api.body_timeout),
            ("api.write_timeout", self.api.write_timeout),
            ("pipeline.wait", p.wait),
            ("pipeline.poll_interval", p.poll_interval),
            ("pipeline.visibility_timeout", p.visibility_timeout),
            ("pipeline.shutdown_deadline", p.shutdown_deadline),
            ("pipeline.evaluator.latency", p.evaluator.latency),
            ("pipeline.evaluator.jitter", p.evaluator.jitter),
            ("pipeline.evaluator.slow_latency", p.evaluator.slow_latency),
            ("notifier.lease", n.lease),
            ("notifier.timeout", n.timeout),
            ("notifier.idle", n.idle),
            ("notifier.retry.base", n.retry.base),
            ("notifier.retry.max", n.retry.max),
            (
                "service.entity_lock_timeout",
                self.service.entity_lock_timeout,
            ),
            (
                "service.declaration_lock_timeout",
                self.service.declaration_lock_timeout,
            ),
            ("maintenance.reaper.interval", m.reaper.interval),
            ("maintenance.redriver.interval", m.redriver.interval),
            ("maintenance.cleaner.interval", m.cleaner.interval),
        ];
        if let Some((key, _)) = settings.iter().find(|(_, d)| *d > LONGEST_SETTING) {
            return Err(invalid(key, "must be at most a year"));
        }
        // A bound at or under the pipeline's own would drop its handlers
        // before they were abandoned and their messages handed back.
        if let Some(timeout) = self.shutdown.timeout
            && (timeout <= p.shutdown_deadline + PIPELINE_GRACE || timeout > LONGEST_SETTING)
        {
            return Err(invalid(
                "shutdown.timeout",
                format!(
                    "must be longer than pipeline.shutdown_deadline plus 5s ({:?}) and at most a year",
                    p.shutdown_deadline + PIPELINE_GRACE
                ),
            ));
        }
        // PostgreSQL's lock_timeout is an int of milliseconds, and 0 there
        // means no bound: `Service::new` refuses a wait under 1 ms or past
        // the int, which is after the migrations ran.
        for (key, timeout) in [
            (
                "service.entity_lock_timeout",
                self.service.entity_lock_timeout,
            ),
            (
                "service.declaration_lock_timeout",
                self.service.declaration_lock_timeout,
            ),
        ] {
            if timeout < Duration::from_millis(1) || timeout > pgonce::lock::MAX_LOCK_TIMEOUT {
                return Err(invalid(
                    key,
                    "must be 1ms to 24d 20h 31m 23s 647ms (PostgreSQL's lock_timeout)",
                ));
            }
        }
        if p.failure_visibility
            .is_some_and(|v| v > pgonce::queue::MAX_VISIBILITY)
        {
            return Err(invalid(
                "pipeline.failure_visibility",
                "must be at most 12h",
            ));
        }
        if self.database.url.as_deref().is_none_or(str::is_empty) {
            return Err(invalid(
                "database.url",
                "no database: set it in the file, DATABASE_URL or PGONCE_DATABASE__URL, or pass --database-url",
            ));
        }
        if !(2..=MAX_CONNECTIONS).contains(&self.database.max_connections) {
            return Err(invalid(
                "database.max_connections",
                format!("must be 2 to {MAX_CONNECTIONS}"),
            ));
        }
        for (key, url) in [
            ("database.url", self.database.url.as_deref()),
            ("database.direct_url", self.database.direct_url.as_deref()),
        ] {
            if let Some(url) = url.filter(|u| !u.is_empty()) {
                check_postgres_url(url).map_err(|why| invalid(key, why))?;
            }
        }
        if let Some(unknown) = self
            .maintenance
            .cleaner
            .keep
            .iter()
            .find(|k| !CLEANED.contains(&k.as_str()))
        {
            return Err(invalid(
                "maintenance.cleaner.keep",
                format!("unknown kind {unknown:?}; one of {CLEANED:?}"),
            ));
        }
        if self.maintenance.cleaner.interval.is_zero() {
            return Err(invalid(
                "maintenance.cleaner.interval",
                "must be above zero",
            ));
        }
        if self.maintenance.cleaner.batch_size < 1 {
            return Err(invalid(
                "maintenance.cleaner.batch_size",
                "must be at least 1",
            ));
        }
        if let Err(e) = self.maintenance.cleaner.maintenance_config().validate() {
            return Err(invalid("maintenance.cleaner", e.to_string()));
        }
        if let Some(retention) = self.maintenance.cleaner.observations {
            let ledger = LedgerCleanerConfig {
                retention,
                interval: self.maintenance.cleaner.interval,
                batch_size: self.maintenance.cleaner.batch_size,
            };
            if let Err(e) = ledger.validate() {
                let why = match e {
                    crate::Error::Invalid { why, .. } => why,
                    other => other.to_string(),
                };
                return Err(invalid("maintenance.cleaner.observations", why));
            }
        }
        if self.database.acquire_timeout.is_zero() {
            return Err(invalid("database.acquire_timeout", "must be above zero"));
        }
        if self.pipeline.workers > MAX_WORKERS {
            return Err(invalid(
                "pipeline.workers",
                format!("must be at most {MAX_WORKERS}"),
            ));
        }
        if self.pipeline.concurrency == 0 {
            return Err(invalid("pipeline.concurrency", "must be at least 1"));
        }
        if !(1..=pgonce::queue::MAX_BATCH).contains(&self.pipeline.batch) {
            return Err(invalid(
                "pipeline.batch",
                format!("must be 1 to {}", pgonce::queue::MAX_BATCH),
            ));
        }
        if self.pipeline.wait > pgonce::queue::MAX_WAIT {
            return Err(invalid("pipeline.wait", "must be at most 12h"));
        }
        if !(Duration::from_secs(1)..=pgonce::queue::MAX_VISIBILITY)
            .contains(&self.pipeline.visibility_timeout)
        {
            return Err(invalid("pipeline.visibility_timeout", "must be 1s to 12h"));
        }
        // The PostgreSQL queue stores it as an int: a larger one was refused
        // only when the queue was opened, after the migrations had run.
        if !(1..=i32::MAX.unsigned_abs()).contains(&self.pipeline.max_receive_count) {
            return Err(invalid(
                "pipeline.max_receive_count",
                "must be 1 to 2147483647",
            ));
        }
        if self.queue.backend == QueueBackend::Sqs {
            self.queue.sqs.validate(
                self.pipeline.max_receive_count,
                self.pipeline.visibility_timeout,
            )?;
        }
        if self.pipeline.poll_interval < Duration::from_millis(1) {
            return Err(invalid("pipeline.poll_interval", "must be at least 1ms"));
        }
        let e = &self.pipeline.evaluator;
        for (key, rate) in [
            ("pipeline.evaluator.failure_rate", e.failure_rate),
            ("pipeline.evaluator.slow_rate", e.slow_rate),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(invalid(key, "must be in [0, 1]"));
            }
        }
        // Parsed, not matched on its first letters: a scheme is
        // case-insensitive (`HTTPS://` is https), and a URL that does not
        // parse is named by its own key.
        if let Some(url) = &self.notifier.webhook_url {
            match reqwest::Url::parse(url) {
                Ok(url) if matches!(url.scheme(), "http" | "https") => {}
                Ok(_) => {
                    return Err(invalid(
                        "notifier.webhook_url",
                        "must be an http:// or https:// URL",
                    ));
                }
                Err(e) => {
                    return Err(invalid("notifier.webhook_url", format!("not a URL: {e}")));
                }
            }
        }
        if self.notifier.webhook_url.is_some() {
            self.validate_notifier()?;
        }
        if self.service.notify_max_attempts < 1 {
            return Err(invalid("service.notify_max_attempts", "must be at least 1"));
        }
        self.validate_api()?;
        // What the sections' own checks below refuse is refused above
        // under the key that sets it; they stay as a backstop, naming the
        // section, for a check added to the library later.
        if let Some(notifier) = self.notifier_config() {
            notifier.validate().map_err(|e| invalid("notifier", e))?;
        }
        self.api_config()
            .validate()
            .map_err(|e| invalid("api", e))?;
        self.worker_config()
            .validate()
            .map_err(|e| invalid("pipeline", e))?;
        for (interval_key, batch_size_key, pass) in [
            (
                "maintenance.reaper.interval",
                "maintenance.reaper.batch_size",
                &self.maintenance.reaper,
            ),
            (
                "maintenance.redriver.interval",
                "maintenance.redriver.batch_size",
                &self.maintenance.redriver,
            ),
        ] {
            if pass.interval.is_zero() {
                return Err(invalid(interval_key, "must be above zero"));
            }
            if pass.batch_size < 1 {
                return Err(invalid(batch_size_key, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// `[notifier]`'s keys, when it has a `webhook_url`: what
    /// [`NotifierConfig::validate`] refuses, by key.
    fn validate_notifier(&self) -> Result<(), ConfigError> {
        let n = &self.notifier;
        if let Some(url) = &n.webhook_url
            && let Err(e) = reqwest::Url::parse(url)
        {
            return Err(invalid("notifier.webhook_url", format!("not a URL: {e}")));
        }
        if n.batch < 1 {
            return Err(invalid("notifier.batch", "must be at least 1"));
        }
        for (key, d) in [("notifier.timeout", n.timeout), ("notifier.idle", n.idle)] {
            if d.is_zero() {
                return Err(invalid(key, "must be above zero"));
            }
        }
        if n.lease <= n.timeout {
            return Err(invalid(
                "notifier.lease",
                "must be longer than notifier.timeout (a send still under way would be taken over)",
            ));
        }
        if n.retry.base < crate::notifier::MIN_RETRY_BASE {
            return Err(invalid(
                "notifier.retry.base",
                "must be at least 1ms (a base of zero retries a failed send at once)",
            ));
        }
        if n.retry.max < n.retry.base {
            return Err(invalid(
                "notifier.retry.max",
                "must be at least notifier.retry.base",
            ));
        }
        if !(0.0..=1.0).contains(&n.retry.jitter) {
            return Err(invalid("notifier.retry.jitter", "must be in [0, 1]"));
        }
        Ok(())
    }

    /// `[api]`'s keys: what [`ApiConfig::validate`] refuses, by key.
    fn validate_api(&self) -> Result<(), ConfigError> {
        let a = &self.api;
        if let Some(token) = &a.admin_token
            && (token.len() < 16 || token.trim() != token)
        {
            return Err(invalid(
                "api.admin_token",
                "must be at least 16 bytes, without whitespace around it",
            ));
        }
        if !(1024..=crate::api::MAX_BODY_LIMIT).contains(&a.body_limit) {
            return Err(invalid(
                "api.body_limit",
                format!("must be 1024 to {} (bytes)", crate::api::MAX_BODY_LIMIT),
            ));
        }
        for (key, d) in [
            ("api.header_timeout", a.header_timeout),
            ("api.body_timeout", a.body_timeout),
            ("api.write_timeout", a.write_timeout),
        ] {
            if d.is_zero() {
                return Err(invalid(key, "must be above zero"));
            }
        }
        Ok(())
    }

    /// The URL for sessions of their own (migrations, LISTEN): `direct_url`,
    /// else `url`.
    pub fn direct_url(&self) -> Option<&str> {
        self.direct_database().map(|(_, url)| url)
    }

    /// [`Config::direct_url`] and the key it comes from
    /// (`database.direct_url` or `database.url`), for errors that name it.
    pub fn direct_database(&self) -> Option<(&'static str, &str)> {
        match self
            .database
            .direct_url
            .as_deref()
            .filter(|u| !u.is_empty())
        {
            Some(url) => Some(("database.direct_url", url)),
            None => Some(("database.url", self.database.url.as_deref()?)),
        }
    }

    /// The [`ServiceConfig`] of `[service]`.
    pub fn service_config(&self) -> ServiceConfig {
        ServiceConfig {
            numbering: self.service.numbering.into(),
            entity_lock_timeout: self.service.entity_lock_timeout,
            declaration_lock_timeout: self.service.declaration_lock_timeout,
            notify_max_attempts: self.service.notify_max_attempts,
        }
    }

    /// The [`ApiConfig`] of `[api]`.
    pub fn api_config(&self) -> ApiConfig {
        ApiConfig {
            admin_token: self.api.admin_token.clone(),
            body_limit: self.api.body_limit,
            max_wait: self.api.max_wait,
            header_timeout: self.api.header_timeout,
            body_timeout: self.api.body_timeout,
            write_timeout: self.api.write_timeout,
        }
    }

    /// How the observations queue's handles behave: LISTEN on or off, and
    /// on which URL.
    pub fn queue_options(&self) -> PgQueueOptions {
        PgQueueOptions {
            poll_interval: self.pipeline.poll_interval,
            listen: self.listen(),
            ..PgQueueOptions::default()
        }
    }

    /// Where LISTEN goes: nowhere with `database.listen = false`, over
    /// `direct_url` when it is set, else on a connection like the pool's.
    pub fn listen(&self) -> Listen {
        if !self.database.listen {
            return Listen::Off;
        }
        match self
            .database
            .direct_url
            .as_deref()
            .filter(|u| !u.is_empty())
        {
            // validate() has parsed it.
            Some(url) => PgConnectOptions::from_str(url)
                .map(|o| Listen::Direct(Box::new(o)))
                .unwrap_or(Listen::Pool),
            None => Listen::Pool,
        }
    }

    /// The [`WorkerConfig`] of `[pipeline]`. The heartbeat extends a
    /// message's visibility by a whole `visibility_timeout` every third of
    /// one, so a message still being handled stays hidden from other
    /// workers however short the timeout.
    pub fn worker_config(&self) -> WorkerConfig {
        let visibility = self.pipeline.visibility_timeout;
        WorkerConfig {
            concurrency: self.pipeline.concurrency,
            batch: self.pipeline.batch,
            wait: self.pipeline.wait,
            // A message still being handled keeps its visibility: the
            // heartbeat extends it by a whole timeout every third of one (a
            // fixed heartbeat would let a shorter timeout run out
            // mid-evaluation and hand the message to a second worker).
            visibility: Some(visibility),
            heartbeat_interval: Some(visibility / 3),
            heartbeat_extension: visibility,
            failure_visibility: self.pipeline.failure_visibility,
            shutdown_deadline: self.pipeline.shutdown_deadline,
            ..WorkerConfig::default()
        }
    }

    fn notifier_config(&self) -> Option<NotifierConfig> {
        let n = &self.notifier;
        let url = n.webhook_url.clone()?;
        Some(NotifierConfig {
            batch: n.batch,
            lease: n.lease,
            timeout: n.timeout,
            idle: n.idle,
            retry: RetryPolicy {
                base: n.retry.base,
                max: n.retry.max,
                jitter: n.retry.jitter,
            },
            ..NotifierConfig::new(url)
        })
    }

    /// `shutdown.timeout`, or, unset, `pipeline.shutdown_deadline` plus
    /// 30 s (60 s with the defaults).
    pub fn shutdown_timeout(&self) -> Duration {
        self.shutdown
            .timeout
            .unwrap_or(self.pipeline.shutdown_deadline + SHUTDOWN_MARGIN)
    }

    /// The [`RuntimeConfig`] of `[pipeline]`, `[notifier]` (no notifier
    /// without a `webhook_url`) and `[maintenance]`.
    pub fn runtime_config(&self) -> RuntimeConfig {
        let e = &self.pipeline.evaluator;
        RuntimeConfig {
            workers: self.pipeline.workers,
            worker: self.worker_config(),
            evaluator: SimulatedEvaluatorConfig {
                latency: e.latency,
                jitter: e.jitter,
                failure_rate: e.failure_rate,
                slow_rate: e.slow_rate,
                slow_latency: e.slow_latency,
            },
            notifier: self.notifier_config(),
            job_maintenance: self.maintenance.enabled,
            reaper: ReaperConfig::from(&self.maintenance.reaper),
            redriver: RedriverConfig {
                interval: self.maintenance.redriver.interval,
                batch_size: self.maintenance.redriver.batch_size,
                // The service's re-driver hands nothing on (`run`).
                ..RedriverConfig::default()
            },
            ledger_cleaner: self.maintenance.cleaner.ledger_cleaner_config(),
        }
    }
}

/// Why `url` is not a PostgreSQL URL, if it is not. sqlx parses any
/// scheme as PostgreSQL's (a `mysql://` URL connected to the PostgreSQL on
/// its host and port), so the scheme is checked here. The reason never
/// repeats the URL, which may hold a password.
fn check_postgres_url(url: &str) -> Result<(), String> {
    let scheme = url.split_once("://").map(|(scheme, _)| scheme);
    match scheme {
        Some("postgres" | "postgresql") => PgConnectOptions::from_str(url)
            .map(drop)
            .map_err(|e| format!("not a PostgreSQL URL: {}", url_error_reason(&e))),
        _ => Err("not a PostgreSQL URL: it must start with postgres:// or postgresql://".into()),
    }
}

/// What is wrong with a URL sqlx refused, without sqlx's `error with
/// configuration:` wrapper: sqlx wraps a bad query parameter's error in
/// `Error::Configuration` twice, each adding the words again.
fn url_error_reason(e: &sqlx::Error) -> String {
    let mut reason: &(dyn std::error::Error + 'static) = e;
    while let Some(sqlx::Error::Configuration(inner)) = reason.downcast_ref::<sqlx::Error>() {
        reason = inner.as_ref();
    }
    reason.to_string()
}

impl From<&PassSection> for ReaperConfig {
    fn from(p: &PassSection) -> Self {
        ReaperConfig {
            interval: p.interval,
            batch_size: p.batch_size,
        }
    }
}
