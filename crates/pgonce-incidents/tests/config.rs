//! The service's configuration: defaults, then a TOML file, then the
//! environment; every section reachable; unknown keys and bad values
//! refused with the key named; validation naming the key.

use std::time::Duration;

use pgonce_incidents::config::{Config, ConfigError, Numbering};

fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
    vars.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn file(text: &str) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), text).unwrap();
    f
}

fn with_url() -> Config {
    let mut c = Config::default();
    c.database.url = Some("postgres://x/y".into());
    c
}

#[test]
fn defaults_then_file_then_environment() {
    let none = Config::load(None, env(&[])).unwrap();
    assert_eq!(none, Config::default());
    assert_eq!(none.api.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(none.database.acquire_timeout, Duration::from_secs(5));

    let f = file(
        r#"
[api]
listen = "0.0.0.0:9000"
max_wait = "1m"
[database]
url = "postgres://file/db"
[pipeline]
workers = 5
visibility_timeout = "45s"
"#,
    );
    let from_file = Config::load(Some(f.path()), env(&[])).unwrap();
    assert_eq!(from_file.api.listen.to_string(), "0.0.0.0:9000");
    assert_eq!(from_file.api.max_wait, Duration::from_secs(60));
    assert_eq!(from_file.pipeline.workers, 5);
    assert_eq!(from_file.pipeline.concurrency, 4);
    assert_eq!(
        from_file.pipeline.visibility_timeout,
        Duration::from_secs(45)
    );

    let vars = env(&[
        ("PGONCE_PIPELINE__WORKERS", "7"),
        ("DATABASE_URL", "postgres://env/db"),
        ("PGONCE_API__ADMIN_TOKEN", "0123456789abcdef"),
        ("PGONCE_PIPELINE__EVALUATOR__LATENCY", "5ms"),
        ("UNRELATED", "ignored"),
        // The test kit's and the test suite's knobs, named outside PGONCE_.
        ("PG_BINDIR", "/usr/lib/postgresql/17/bin"),
        ("PGBOUNCER_BIN", "/root/.cache/pgonce/pgbouncer"),
        ("MODEL_TEST_CASES", "2000"),
        ("API_FUZZ_EXAMPLES", "60"),
    ]);
    let both = Config::load(Some(f.path()), vars).unwrap();
    assert_eq!(both.pipeline.workers, 7);
    assert_eq!(both.api.listen.to_string(), "0.0.0.0:9000");
    assert_eq!(both.database.url.as_deref(), Some("postgres://env/db"));
    assert_eq!(both.api.admin_token.as_deref(), Some("0123456789abcdef"));
    assert_eq!(both.pipeline.evaluator.latency, Duration::from_millis(5));
    both.validate().unwrap();

    // PGONCE_DATABASE__URL over the flat PGONCE_DATABASE_URL over DATABASE_URL.
    let vars = env(&[
        ("DATABASE_URL", "postgres://env/db"),
        ("PGONCE_DATABASE_URL", "postgres://pgonce/db"),
    ]);
    let url = Config::load(None, vars).unwrap().database.url;
    assert_eq!(url.as_deref(), Some("postgres://pgonce/db"));
    let vars = env(&[
        ("PGONCE_DATABASE__URL", "postgres://nested/db"),
        ("DATABASE_URL", "postgres://env/db"),
        ("PGONCE_DATABASE_URL", "postgres://pgonce/db"),
    ]);
    let url = Config::load(None, vars).unwrap().database.url;
    assert_eq!(url.as_deref(), Some("postgres://nested/db"));
}

/// The flat names of earlier versions keep working, bare numbers of the
/// `_SECS`/`_MS` ones in their unit; an empty variable is unset.
#[test]
fn the_flat_environment_names_still_work() {
    let vars = env(&[
        ("PGONCE_LISTEN", "0.0.0.0:7000"),
        ("PGONCE_METRICS_LISTEN", "127.0.0.1:7001"),
        ("PGONCE_WORKERS", "3"),
        ("PGONCE_MAX_WAIT_SECS", "12"),
        ("PGONCE_VISIBILITY_TIMEOUT_SECS", "9"),
        ("PGONCE_EVALUATOR_LATENCY_MS", "7"),
        ("PGONCE_EVALUATOR_FAILURE_RATE", "0.5"),
        ("PGONCE_WEBHOOK_URL", ""),
        ("PGONCE_ADMIN_TOKEN", "12345678901234567890"),
    ]);
    let c = Config::load(None, vars).unwrap();
    assert_eq!(c.api.listen.to_string(), "0.0.0.0:7000");
    assert_eq!(c.api.metrics_listen.unwrap().to_string(), "127.0.0.1:7001");
    assert_eq!(c.pipeline.workers, 3);
    assert_eq!(c.api.max_wait, Duration::from_secs(12));
    assert_eq!(c.pipeline.visibility_timeout, Duration::from_secs(9));
    assert_eq!(c.pipeline.evaluator.latency, Duration::from_millis(7));
    assert_eq!(c.pipeline.evaluator.failure_rate, 0.5);
    assert_eq!(c.notifier.webhook_url, None);
    // Text stays text even when it looks like a number.
    assert_eq!(c.api.admin_token.as_deref(), Some("12345678901234567890"));
}

/// Every knob of the service, the reaper, the re-driver, the notifier, the
/// queue and the pool reaches the configuration the runtime is built from.
#[test]
fn every_section_reaches_what_it_configures() {
    let f = file(
        r#"
[database]
url = "postgres://pooler:6432/db"
direct_url = "postgres://primary:5432/db"
acquire_timeout = "750ms"
listen = false
[service]
numbering = "counter_row"
entity_lock_timeout = "3s"
declaration_lock_timeout = "2s"
notify_max_attempts = 4
[maintenance]
enabled = false
reaper = { interval = "2s", batch_size = 10 }
redriver = { interval = "5m", batch_size = 20 }
[notifier]
webhook_url = "https://hooks.example/x"
lease = "1m"
retry = { base = "2s", max = "1h", jitter = 0.1 }
[pipeline]
poll_interval = "250ms"
failure_visibility = "3s"
[api]
header_timeout = "4s"
body_timeout = "6s"
write_timeout = "2s"
"#,
    );
    let c = Config::load(Some(f.path()), env(&[])).unwrap();
    c.validate().unwrap();
    let api = c.api_config();
    assert_eq!(
        (api.header_timeout, api.body_timeout, api.write_timeout),
        (
            Duration::from_secs(4),
            Duration::from_secs(6),
            Duration::from_secs(2)
        )
    );
    assert_eq!(c.service.numbering, Numbering::CounterRow);
    let service = c.service_config();
    assert_eq!(service.numbering, pgonce::SequenceStrategy::CounterRow);
    assert_eq!(service.entity_lock_timeout, Duration::from_secs(3));
    assert_eq!(service.declaration_lock_timeout, Duration::from_secs(2));
    assert_eq!(service.notify_max_attempts, 4);
    let runtime = c.runtime_config();
    assert!(!runtime.job_maintenance);
    assert_eq!(runtime.reaper.interval, Duration::from_secs(2));
    assert_eq!(runtime.reaper.batch_size, 10);
    assert_eq!(runtime.redriver.interval, Duration::from_secs(300));
    assert_eq!(runtime.redriver.batch_size, 20);
    let notifier = runtime.notifier.unwrap();
    assert_eq!(notifier.webhook_url, "https://hooks.example/x");
    assert_eq!(notifier.lease, Duration::from_secs(60));
    assert_eq!(notifier.retry.max, Duration::from_secs(3600));
    assert_eq!(
        runtime.worker.failure_visibility,
        Some(Duration::from_secs(3))
    );
    let queue = c.queue_options();
    assert!(matches!(queue.listen, pgonce::Listen::Off));
    assert_eq!(queue.poll_interval, Duration::from_millis(250));
    assert_eq!(c.direct_url(), Some("postgres://primary:5432/db"));
    assert_eq!(c.database.acquire_timeout, Duration::from_millis(750));
    // Without direct_url, everything uses url.
    assert_eq!(with_url().direct_url(), Some("postgres://x/y"));
    assert!(matches!(
        with_url().queue_options().listen,
        pgonce::Listen::Pool
    ));
}

#[test]
fn a_short_visibility_timeout_gets_a_heartbeat_inside_it() {
    for secs in [1, 3, 30] {
        let mut config = with_url();
        config.pipeline.visibility_timeout = Duration::from_secs(secs);
        config.validate().unwrap();
        let worker = config.runtime_config().worker;
        worker.validate().unwrap();
        let visibility = Duration::from_secs(secs);
        assert!(worker.heartbeat_interval.unwrap() < visibility, "{secs} s");
        assert_eq!(worker.heartbeat_extension, visibility);
    }
}

fn load_err(text: &str, vars: &[(&str, &str)]) -> String {
    let f = file(text);
    let e = Config::load(Some(f.path()), env(vars)).unwrap_err();
    assert!(matches!(e, ConfigError::Load(_)), "{e:?}");
    e.to_string()
}

#[test]
fn unknown_keys_and_bad_values_are_refused_with_the_key_named() {
    // A misspelt key in a section, an unknown section, a flat key that
    // belongs in a section.
    let e = load_err("[pipeline]\nwokers = 3\n", &[]);
    assert!(e.contains("wokers") && e.contains("pipeline"), "{e}");
    let e = load_err("[pipelin]\nworkers = 3\n", &[]);
    assert!(e.contains("pipelin"), "{e}");
    let e = load_err("workers = 3\n", &[]);
    assert!(e.contains("workers"), "{e}");
    // A value of the wrong type, a duration without its unit.
    let e = load_err("[pipeline]\nworkers = \"many\"\n", &[]);
    assert!(
        e.contains("pipeline.workers") || e.contains("workers"),
        "{e}"
    );
    let e = load_err("[api]\nmax_wait = 30\n", &[]);
    assert!(e.contains("max_wait"), "{e}");
    let e = load_err("[service]\nnumbering = \"select_for_update\"\n", &[]);
    assert!(e.contains("select_for_update"), "{e}");
    // The environment: the variable is named.
    let e = load_err("", &[("PGONCE_LISTEN", "nowhere")]);
    assert!(e.contains("PGONCE_LISTEN"), "{e}");
    let e = load_err("", &[("PGONCE_API__LISTEN", "nowhere")]);
    assert!(e.contains("PGONCE_API__LISTEN"), "{e}");
    let e = load_err("", &[("PGONCE_PIPELINE__WOKERS", "3")]);
    assert!(
        e.contains("wokers") && e.contains("PGONCE_PIPELINE__WOKERS"),
        "{e}"
    );
    let e = load_err("", &[("PGONCE_WOKERS", "3")]);
    assert!(e.contains("wokers"), "{e}");
    // No PGONCE_ name is set aside for a test's knobs, nor for the test
    // kit's (the server binaries, PgBouncer) under their former names.
    for test_knob in [
        "PGONCE_FUZZ_EXAMPLES",
        "PGONCE_PROPTEST_CASES",
        "PGONCE_PG_BINDIR",
        "PGONCE_PGBOUNCER",
    ] {
        let e = load_err("", &[(test_knob, "60")]);
        assert!(e.contains(test_knob), "{e}");
    }
    // A file that is not there is an error, not an empty file.
    let e = Config::load(Some("/nonexistent/pgonce.toml".as_ref()), env(&[])).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/pgonce.toml"), "{e}");
}

#[test]
fn what_cannot_work_is_refused_with_the_key_named() {
    with_url().validate().unwrap();
    // As large a pool as PostgreSQL's own max_connections allows.
    let mut largest = with_url();
    largest.database.max_connections = 262_143;
    largest.validate().unwrap();
    type Bad = fn(&mut Config);
    let cases: [(Bad, &str); 31] = [
        (|c| c.database.url = None, "database.url"),
        (
            |c| c.database.max_connections = 1,
            "database.max_connections",
        ),
        (
            |c| c.database.max_connections = u32::MAX,
            "database.max_connections",
        ),
        (
            |c| c.database.acquire_timeout = Duration::ZERO,
            "database.acquire_timeout",
        ),
        (|c| c.pipeline.concurrency = 0, "pipeline.concurrency"),
        (
            |c| c.pipeline.evaluator.failure_rate = 2.0,
            "pipeline.evaluator.failure_rate",
        ),
        (
            |c| c.pipeline.visibility_timeout = Duration::from_millis(10),
            "pipeline.visibility_timeout",
        ),
        (
            |c| c.notifier.webhook_url = Some("ftp://x".into()),
            "notifier.webhook_url",
        ),
        (
            |c| c.notifier.webhook_url = Some("http://hooks example/x".into()),
            "notifier.webhook_url",
        ),
        (
            |c| c.notifier.webhook_url = Some("https://".into()),
            "notifier.webhook_url",
        ),
        (
            |c| {
                c.notifier.webhook_url = Some("http://x".into());
                c.notifier.lease = Duration::from_secs(1);
            },
            "notifier.lease",
        ),
        (
            |c| {
                c.notifier.webhook_url = Some("http://x".into());
                c.notifier.lease = pgonce::job::MAX_LEASE + Duration::from_secs(1);
            },
            "notifier.lease",
        ),
        (
            |c| {
                c.notifier.webhook_url = Some("http://x".into());
                c.notifier.retry.base = Duration::ZERO;
            },
            "notifier.retry.base",
        ),
        (
            |c| c.api.admin_token = Some("short".into()),
            "api.admin_token",
        ),
        (
            |c| c.api.admin_token = Some("0123456789abcdef ".into()),
            "api.admin_token",
        ),
        (
            |c| {
                c.notifier.webhook_url = Some("http://x".into());
                c.notifier.timeout = Duration::ZERO;
            },
            "notifier.timeout",
        ),
        (|c| c.api.max_wait = Duration::MAX, "api.max_wait"),
        (|c| c.pipeline.workers = 1_000_000_000, "pipeline.workers"),
        (
            |c| c.database.acquire_timeout = Duration::from_secs(400 * 24 * 3600),
            "database.acquire_timeout",
        ),
        (
            |c| c.pipeline.failure_visibility = Some(Duration::from_secs(13 * 3600)),
            "pipeline.failure_visibility",
        ),
        // Under a year, past what PostgreSQL's lock_timeout holds: refused
        // with the file, not when the service starts.
        (
            |c| c.service.entity_lock_timeout = Duration::from_secs(30 * 24 * 3600),
            "service.entity_lock_timeout",
        ),
        (
            |c| c.service.declaration_lock_timeout = Duration::from_secs(30 * 24 * 3600),
            "service.declaration_lock_timeout",
        ),
        // 0 is no bound in PostgreSQL's lock_timeout, and under 1 ms the
        // service cannot hold: refused with the file, not after migrating.
        (
            |c| c.service.entity_lock_timeout = Duration::ZERO,
            "service.entity_lock_timeout",
        ),
        (
            |c| c.service.declaration_lock_timeout = Duration::ZERO,
            "service.declaration_lock_timeout",
        ),
        (
            |c| c.service.entity_lock_timeout = Duration::from_micros(500),
            "service.entity_lock_timeout",
        ),
        (
            |c| c.service.declaration_lock_timeout = Duration::from_micros(500),
            "service.declaration_lock_timeout",
        ),
        (|c| c.api.body_limit = 10, "api.body_limit"),
        (|c| c.api.body_limit = usize::MAX, "api.body_limit"),
        (
            |c| c.maintenance.reaper.batch_size = 0,
            "maintenance.reaper.batch_size",
        ),
        (
            |c| c.maintenance.redriver.interval = Duration::ZERO,
            "maintenance.redriver.interval",
        ),
        (
            |c| c.maintenance.cleaner.dead_jobs = Duration::from_secs(10_000 * 365 * 24 * 3600),
            "maintenance.cleaner",
        ),
    ];
    for (bad, needle) in cases {
        let mut c = with_url();
        bad(&mut c);
        let e = c.validate().unwrap_err();
        assert!(matches!(e, ConfigError::Invalid { .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.starts_with(&format!("{needle}: ")), "{needle}: {e}");
    }
}

/// `[service]` values `validate` accepts, `Service::new` accepts, and the
/// ones it refuses `validate` refuses first, at each bound of the lock
/// waits. (A lazy pool: `Service::new` does not connect.)
#[tokio::test]
async fn the_service_accepts_what_validate_accepts() {
    use pgonce_incidents::service::Service;

    let pool = sqlx::PgPool::connect_lazy("postgres://x/y").unwrap();
    let max = pgonce::lock::MAX_LOCK_TIMEOUT;
    let one_ns = Duration::from_nanos(1);
    let ms = Duration::from_millis(1);
    for (timeout, valid) in [
        (Duration::ZERO, false),
        (ms - one_ns, false),
        (ms, true),
        (max, true),
        (max + one_ns, false),
    ] {
        for declaration in [false, true] {
            let mut c = with_url();
            if declaration {
                c.service.declaration_lock_timeout = timeout;
            } else {
                c.service.entity_lock_timeout = timeout;
            }
            let validated = c.validate();
            assert_eq!(validated.is_ok(), valid, "{timeout:?}: {validated:?}");
            let started = Service::new(pool.clone(), c.service_config());
            assert_eq!(started.is_ok(), valid, "{timeout:?}: {:?}", started.err());
        }
    }
}

/// `shutdown.timeout` follows `pipeline.shutdown_deadline` when unset;
/// set, it must leave the pipeline its deadline and the 5 s of acks and
/// hand-backs after it, and is refused otherwise, named; read from the
/// environment too.
#[test]
fn the_shutdown_timeout_outlasts_the_pipelines_deadline() {
    let c = with_url();
    assert_eq!(c.shutdown_timeout(), Duration::from_secs(60));
    let mut longer = with_url();
    longer.pipeline.shutdown_deadline = Duration::from_secs(3600);
    longer.validate().unwrap();
    assert_eq!(longer.shutdown_timeout(), Duration::from_secs(3630));
    for (timeout, valid) in [
        (Duration::ZERO, false),
        (Duration::from_secs(35), false),
        (Duration::from_millis(35_001), true),
        (Duration::from_secs(365 * 24 * 3600), true),
        (Duration::from_secs(365 * 24 * 3600 + 1), false),
    ] {
        let mut c = with_url();
        c.shutdown.timeout = Some(timeout);
        match c.validate() {
            Ok(()) => {
                assert!(valid, "{timeout:?} accepted");
                assert_eq!(c.shutdown_timeout(), timeout);
            }
            Err(e) => {
                assert!(!valid, "{timeout:?}: {e}");
                let e = e.to_string();
                assert!(
                    e.starts_with("shutdown.timeout: must be longer than pipeline.shutdown_deadline plus 5s (35s)"),
                    "{e}"
                );
            }
        }
    }
    let c = Config::load(
        None,
        env(&[
            ("DATABASE_URL", "postgres://x/y"),
            ("PGONCE_SHUTDOWN__TIMEOUT", "2m"),
        ]),
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(c.shutdown_timeout(), Duration::from_secs(120));
}

#[test]
fn the_cleaners_retention_is_configurable_and_keep_names_known_kinds() {
    let f = file(
        "[database]\nurl = \"postgres://x/y\"\n\
         [maintenance.cleaner]\ncompleted_jobs = \"2h\"\nbatch_size = 50\nkeep = [\"dead_jobs\"]\n",
    );
    let c = Config::load(Some(f.path()), env(&[])).unwrap();
    c.validate().unwrap();
    let m = c.maintenance.cleaner.maintenance_config();
    assert_eq!(m.completed_jobs, Some(Duration::from_secs(7200)));
    assert_eq!(m.batch_size, 50);
    assert_eq!(m.dead_jobs, None, "kept forever");
    assert_eq!(
        m.processed_messages,
        Some(Duration::from_secs(7 * 24 * 3600))
    );

    let mut typo = with_url();
    typo.maintenance.cleaner.keep = vec!["dead_job".into()];
    let err = typo.validate().unwrap_err().to_string();
    assert!(err.contains("maintenance.cleaner.keep"), "{err}");
}

/// `[maintenance.cleaner] observations`: the pipeline ledger's cleaner is
/// off unless set; set, it runs with the cleaner's interval and batch size
/// unless the cleaner is disabled or `keep` names it; under 28 days (a
/// message's time in the queue and its dead-letter queue) and past 1,000
/// years it is refused with the key named.
#[test]
fn the_ledgers_retention_is_off_by_default_and_checked_when_set() {
    let day = Duration::from_secs(24 * 3600);
    let none = with_url();
    none.validate().unwrap();
    assert_eq!(none.maintenance.cleaner.observations, None);
    assert_eq!(none.runtime_config().ledger_cleaner, None, "kept for good");

    let f = file(
        "[database]\nurl = \"postgres://x/y\"\n\
         [maintenance.cleaner]\nobservations = \"30days\"\nbatch_size = 50\ninterval = \"2m\"\n",
    );
    let c = Config::load(Some(f.path()), env(&[])).unwrap();
    c.validate().unwrap();
    let ledger = c.runtime_config().ledger_cleaner.expect("a ledger cleaner");
    assert_eq!(ledger.retention, 30 * day);
    assert_eq!(ledger.batch_size, 50);
    assert_eq!(ledger.interval, Duration::from_secs(120));

    let mut kept = c.clone();
    kept.maintenance.cleaner.keep = vec!["observations".into()];
    kept.validate().unwrap();
    assert_eq!(kept.runtime_config().ledger_cleaner, None);
    let mut disabled = c.clone();
    disabled.maintenance.cleaner.enabled = false;
    assert_eq!(disabled.runtime_config().ledger_cleaner, None);

    for retention in [27 * day, 1001 * 365 * day] {
        let mut bad = c.clone();
        bad.maintenance.cleaner.observations = Some(retention);
        let err = bad.validate().unwrap_err().to_string();
        assert!(
            err.contains("maintenance.cleaner.observations"),
            "{retention:?}: {err}"
        );
    }
}

/// `[queue]`: the backend and the SQS section from the file, overridden
/// from the environment; SQS's limits refused with the key named.
#[test]
fn the_queue_backend_and_sqs_section_load_and_are_checked() {
    use pgonce_incidents::config::QueueBackend;

    let none = Config::load(None, env(&[])).unwrap();
    assert_eq!(none.queue.backend, QueueBackend::Postgres);

    let f = file(
        r#"
[database]
url = "postgres://file/db"
[queue]
backend = "sqs"
[queue.sqs]
queue = "https://sqs.eu-west-1.amazonaws.com/123456789012/obs.fifo"
region = "eu-west-1"
operation_timeout = "3s"
"#,
    );
    let c = Config::load(
        Some(f.path()),
        env(&[
            ("PGONCE_QUEUE__SQS__ENDPOINT_URL", "http://127.0.0.1:5000"),
            ("PGONCE_QUEUE__SQS__DEAD_LETTER_QUEUE", "1234.fifo"),
        ]),
    )
    .unwrap();
    assert_eq!(c.queue.backend, QueueBackend::Sqs);
    assert_eq!(c.queue.sqs.queue_name(), "obs.fifo");
    // A name of digits stays a name, not a number.
    assert_eq!(c.queue.sqs.dead_letter_name(), "1234.fifo");
    let sqs = c.queue.sqs.sqs_config();
    assert_eq!(sqs.endpoint_url.as_deref(), Some("http://127.0.0.1:5000"));
    assert_eq!(sqs.region.as_deref(), Some("eu-west-1"));
    assert_eq!(sqs.operation_timeout, Duration::from_secs(3));
    c.validate().unwrap();

    let refused = |change: &dyn Fn(&mut Config)| {
        let mut c = c.clone();
        change(&mut c);
        match c.validate() {
            Err(ConfigError::Invalid { key, .. }) => key,
            other => panic!("accepted: {other:?}"),
        }
    };
    assert_eq!(
        refused(&|c| c.queue.sqs.queue = "standard".into()),
        "queue.sqs.queue"
    );
    assert_eq!(
        refused(&|c| c.queue.sqs.dead_letter_queue = "obs.fifo".into()),
        "queue.sqs.dead_letter_queue"
    );
    assert_eq!(
        refused(&|c| c.queue.sqs.operation_timeout = Duration::from_millis(10)),
        "queue.sqs.operation_timeout"
    );
    assert_eq!(
        refused(&|c| c.pipeline.max_receive_count = 1001),
        "pipeline.max_receive_count"
    );
    // The PostgreSQL backend does not read [queue.sqs].
    let mut pg = c.clone();
    pg.queue.backend = QueueBackend::Postgres;
    pg.queue.sqs.queue = "standard".into();
    pg.validate().unwrap();

    let e = load_err("[queue]\nbackend = \"kafka\"\n", &[]);
    assert!(e.contains("backend"), "{e}");
}
