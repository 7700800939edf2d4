//! PgBouncer in transaction mode in front of a server, the way most hosted
//! PostgreSQL deployments run: each transaction may land on another server
//! connection, so nothing that lives in a session (a session-level advisory
//! lock, LISTEN, a `SET` without `LOCAL`, a temporary table) survives from
//! one transaction to the next.
//!
//! The binary is the one `PGBOUNCER_BIN` names (`scripts/ensure-pgbouncer.sh`
//! builds 1.24 and sets it), else `pgbouncer` on the `PATH`. It must be 1.21
//! or newer: older versions cannot carry sqlx's named prepared statements in
//! transaction mode. Like [`Cluster`](crate::Cluster), the pooler runs as the
//! `postgres` user when we are root, and a watchdog stops it and removes its
//! directory when this process dies.

use std::io::Write;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use sqlx::postgres::PgConnectOptions;

use crate::cluster::{ClusterError, RunAs, free_port, read_log, spawn_watchdog, stop_process};

/// Environment variable naming the PgBouncer binary.
pub const PGBOUNCER_ENV: &str = "PGBOUNCER_BIN";

/// How long PgBouncer gets to accept connections after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// How a [`Pooler`] is configured: the set-up pgonce supports, or one
/// deliberate mistake, to see what a misconfigured pooler does to a client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolerSetup {
    /// Transaction mode, `max_prepared_statements = 200`,
    /// `ignore_startup_parameters = extra_float_digits,options`.
    #[default]
    Supported,
    /// As `Supported` without `max_prepared_statements`: sqlx's named
    /// prepared statements meet server connections that did not prepare
    /// them (what PgBouncer older than 1.21 always does).
    NoPreparedStatements,
    /// As `Supported` without `ignore_startup_parameters`: PgBouncer
    /// refuses the `extra_float_digits` sqlx sends when connecting.
    StrictStartupParameters,
}

/// A running PgBouncer in transaction mode. Dropping it stops the pooler and
/// removes its directory.
#[derive(Debug)]
pub struct Pooler {
    dir: Option<tempfile::TempDir>,
    process: Option<Child>,
    watchdog: Option<Child>,
    port: u16,
    user: String,
}

impl Pooler {
    /// Starts PgBouncer in `pool_mode = transaction` in front of the server
    /// `upstream` points at. Every database on that server is reachable
    /// through it under its own name, logged in as `upstream`'s user.
    pub fn start(upstream: &PgConnectOptions) -> Result<Pooler, ClusterError> {
        Pooler::start_with(upstream, PoolerSetup::Supported)
    }

    /// [`Pooler::start`] configured as `setup` says.
    pub fn start_with(
        upstream: &PgConnectOptions,
        setup: PoolerSetup,
    ) -> Result<Pooler, ClusterError> {
        let binary = binary();
        let run_as = RunAs::detect()?;
        let dir = tempfile::Builder::new()
            .prefix("pgonce-pgbouncer-")
            .tempdir()
            .map_err(|source| ClusterError::Io {
                doing: "creating the pooler directory",
                source,
            })?;
        run_as.chown(dir.path())?;

        let mut last_err = None;
        for _ in 0..5 {
            let port = free_port()?;
            let config = dir.path().join("pgbouncer.ini");
            write_config(&config, upstream, port, dir.path(), setup)?;
            let mut cmd = Command::new(&binary);
            if run_as.is_other_user() {
                // PgBouncer refuses to run as root; `-u` makes it switch
                // after it has read its configuration.
                cmd.args(["-u", "postgres"]);
            }
            cmd.arg(&config)
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut process = cmd.spawn().map_err(|e| ClusterError::Setup {
                step: "starting PgBouncer",
                detail: format!(
                    "{}: {e}. Run scripts/ensure-pgbouncer.sh, or set {PGBOUNCER_ENV} to a \
                     PgBouncer 1.21 or newer",
                    binary.display()
                ),
                log: String::new(),
            })?;
            match wait_until_listening(&mut process, port) {
                Ok(()) => {
                    let watchdog = spawn_watchdog(process.id(), dir.path())?;
                    tracing::info!(port, ?setup, "started PgBouncer in transaction mode");
                    return Ok(Pooler {
                        dir: Some(dir),
                        process: Some(process),
                        watchdog: Some(watchdog),
                        port,
                        user: upstream.get_username().to_owned(),
                    });
                }
                Err(detail) => {
                    let _ = process.kill();
                    let _ = process.wait();
                    let log = read_log(&dir.path().join("pgbouncer.log"));
                    let bind_failed = log.contains("bind") || log.contains("in use");
                    let err = ClusterError::Setup {
                        step: "starting PgBouncer",
                        detail,
                        log,
                    };
                    if !bind_failed {
                        return Err(err);
                    }
                    last_err = Some(err);
                }
            }
        }
        Err(last_err.expect("loop ran"))
    }

    /// The TCP port PgBouncer listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Options for `database` through the pooler.
    pub fn options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::from_str(&format!(
            "postgres://{}@127.0.0.1:{}/{database}",
            self.user, self.port
        ))
        .expect("a well-formed URL")
    }

    /// Stops PgBouncer and removes its directory. Idempotent; `Drop` calls it.
    pub fn stop(&mut self) {
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        if let Some(mut process) = self.process.take() {
            // SIGTERM: immediate shutdown (SIGINT would wait for clients).
            stop_process(&mut process, Signal::SIGTERM, Duration::from_secs(10));
        }
        if let Some(dir) = self.dir.take() {
            let _ = dir.close();
        }
    }
}

impl Drop for Pooler {
    fn drop(&mut self) {
        self.stop();
    }
}

fn binary() -> PathBuf {
    std::env::var_os(PGBOUNCER_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("pgbouncer"))
}

/// PgBouncer's configuration: transaction pooling, prepared statements
/// carried across server connections (`max_prepared_statements`), every
/// database of the upstream server by its own name; less what `setup`
/// leaves out.
fn write_config(
    path: &std::path::Path,
    upstream: &PgConnectOptions,
    port: u16,
    dir: &std::path::Path,
    setup: PoolerSetup,
) -> Result<(), ClusterError> {
    let io = |source| ClusterError::Io {
        doing: "writing the pooler configuration",
        source,
    };
    let mut file = std::fs::File::create(path).map_err(io)?;
    let host = upstream.get_host();
    // A host that is a socket directory is passed as is; PgBouncer takes
    // both forms in `host=`.
    writeln!(
        file,
        "[databases]\n\
         * = host={host} port={upstream_port} user={user}\n\
         \n\
         [pgbouncer]\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {port}\n\
         unix_socket_dir =\n\
         auth_type = any\n\
         pool_mode = transaction\n\
         max_prepared_statements = {prepared}\n\
         default_pool_size = 20\n\
         max_client_conn = 1000\n\
         ignore_startup_parameters = {ignored}\n\
         server_reset_query =\n\
         logfile = {log}\n\
         pidfile =\n",
        upstream_port = upstream.get_port(),
        user = upstream.get_username(),
        log = dir.join("pgbouncer.log").display(),
        // 0 turns prepared statement tracking off.
        prepared = match setup {
            PoolerSetup::NoPreparedStatements => 0,
            _ => 200,
        },
        ignored = match setup {
            PoolerSetup::StrictStartupParameters => "",
            _ => "extra_float_digits,options",
        },
    )
    .map_err(io)?;
    Ok(())
}

fn wait_until_listening(process: &mut Child, port: u16) -> Result<(), String> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(Some(status)) = process.try_wait() {
            return Err(format!("exited with {status}"));
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "not listening on port {port} within {START_TIMEOUT:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
