//! A throwaway PostgreSQL cluster, started from the binaries installed on this
//! machine and removed when it is no longer needed.
//!
//! Written by hand on purpose: the crates that embed PostgreSQL either refuse
//! to run as root (`postgresql_embedded`, `pgtemp`) or download binaries at run
//! time (`pg-embed`). Our machines run as root and cannot download, so this
//! module finds the installed binaries, runs `initdb` and `postgres` as the
//! `postgres` system user when we are root, and guarantees removal:
//!
//! * [`Cluster::stop`] (and `Drop`) stops the server with a fast shutdown and
//!   removes the directory;
//! * a watchdog process (`sh`, started in its own process group so a terminal
//!   Ctrl-C does not reach it) holds the read end of a pipe whose write end
//!   only this process holds. When this process dies for any reason (panic
//!   with `panic = abort`, SIGKILL, a test binary exiting with the cluster in a
//!   `static`), the pipe closes and the watchdog stops the server and removes
//!   the directory.
//!
//! The server listens on 127.0.0.1 only, on a free port, with its socket in
//! the cluster's own directory, and trusts local connections: it is a scratch
//! server for one run, never a place for data that matters. `fsync` stays on,
//! so benchmarks measure real commit latency.

use std::fs::File;
use std::io::Read;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Gid, Pid, Uid, User};

/// Environment variable naming the directory of the PostgreSQL server
/// binaries (`initdb`, `postgres`); it overrides discovery.
pub const BINDIR_ENV: &str = "PG_BINDIR";

/// The superuser created by `initdb` in every throwaway cluster. Not
/// `pgonce`: the default `search_path` starts with `"$user"`, so a role named
/// like pgonce's schema would put every unqualified table into that schema.
pub const SUPERUSER: &str = "postgres";

/// How long the server gets to accept connections after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a fast shutdown may take before the server is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a throwaway cluster could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// No `initdb`/`postgres` pair was found.
    #[error(
        "no PostgreSQL server binaries found (looked in: {looked_in}). Install them \
         (Debian/Ubuntu: `apt-get install postgresql`), set {BINDIR_ENV} to their directory, \
         or set DATABASE_URL to use a server you already run"
    )]
    NoBinaries {
        /// The places searched, in the order they were searched.
        looked_in: String,
    },
    /// We run as root, which `initdb` refuses, and there is no `postgres` user
    /// to run the server as.
    #[error(
        "running as root, and PostgreSQL refuses to run as root; no `postgres` system user \
         exists to run it as (create one with `useradd --system postgres`), or set DATABASE_URL"
    )]
    NoPostgresUser,
    /// A step of setting up the cluster failed; `log` holds what the server
    /// or `initdb` printed.
    #[error("{step} failed: {detail}{}", if log.is_empty() { String::new() } else { format!("\n--- output ---\n{log}") })]
    Setup {
        /// The step: `initdb`, starting the server, waiting for it...
        step: &'static str,
        /// Why it failed.
        detail: String,
        /// What the server or `initdb` printed (may be empty).
        log: String,
    },
    /// A file-system or process operation failed.
    #[error("I/O error while {doing}: {source}")]
    Io {
        /// What the cluster was doing.
        doing: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

fn io(doing: &'static str) -> impl FnOnce(std::io::Error) -> ClusterError {
    move |source| ClusterError::Io { doing, source }
}

/// Where the server binaries are, and which major version they are.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// The directory holding `initdb`, `postgres` and `pg_ctl`.
    pub bindir: PathBuf,
}

impl Binaries {
    /// Finds the server binaries: `$PG_BINDIR`, then
    /// `pg_config --bindir`, then the newest `/usr/lib/postgresql/*/bin`.
    /// A candidate counts only if it holds both `initdb` and `postgres`.
    pub fn find() -> Result<Binaries, ClusterError> {
        let mut looked_in = Vec::new();
        let mut candidates = Vec::new();
        if let Some(dir) = std::env::var_os(BINDIR_ENV) {
            candidates.push(PathBuf::from(dir));
        }
        if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
            && out.status.success()
        {
            let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
            candidates.push(PathBuf::from(dir));
        }
        candidates.extend(debian_bindirs());
        for dir in candidates {
            if dir.join("initdb").is_file() && dir.join("postgres").is_file() {
                return Ok(Binaries { bindir: dir });
            }
            looked_in.push(dir.display().to_string());
        }
        if looked_in.is_empty() {
            looked_in.push(format!(
                "${BINDIR_ENV} (unset), pg_config (absent), /usr/lib/postgresql/*/bin (none)"
            ));
        }
        Err(ClusterError::NoBinaries {
            looked_in: looked_in.join(", "),
        })
    }

    fn tool(&self, name: &str) -> PathBuf {
        self.bindir.join(name)
    }
}

/// `/usr/lib/postgresql/<major>/bin`, newest major first.
fn debian_bindirs() -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") else {
        return Vec::new();
    };
    let mut versions: Vec<(u32, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((major, e.path().join("bin")))
        })
        .collect();
    versions.sort_by_key(|v| std::cmp::Reverse(v.0));
    versions.into_iter().map(|(_, p)| p).collect()
}

/// The account the server processes run as: ourselves, or `postgres` when we
/// are root.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunAs {
    ids: Option<(Uid, Gid)>,
}

impl RunAs {
    pub(crate) fn detect() -> Result<RunAs, ClusterError> {
        if !Uid::effective().is_root() {
            return Ok(RunAs { ids: None });
        }
        match User::from_name("postgres") {
            Ok(Some(user)) => Ok(RunAs {
                ids: Some((user.uid, user.gid)),
            }),
            _ => Err(ClusterError::NoPostgresUser),
        }
    }

    /// Makes `cmd` run as this account. `std` drops supplementary groups
    /// when root sets a uid, so the child keeps no root group either.
    fn apply(&self, cmd: &mut Command) {
        if let Some((uid, gid)) = self.ids {
            cmd.uid(uid.as_raw()).gid(gid.as_raw());
        }
    }

    /// True when the server processes run as another user than ours.
    pub(crate) fn is_other_user(&self) -> bool {
        self.ids.is_some()
    }

    pub(crate) fn chown(&self, path: &Path) -> Result<(), ClusterError> {
        if let Some((uid, gid)) = self.ids {
            std::os::unix::fs::chown(path, Some(uid.as_raw()), Some(gid.as_raw()))
                .map_err(io("handing the cluster directory to the postgres user"))?;
        }
        Ok(())
    }
}

/// A running throwaway cluster. Dropping it stops the server and removes its
/// directory; so does the death of this process (see the module docs).
#[derive(Debug)]
pub struct Cluster {
    dir: Option<tempfile::TempDir>,
    server: Option<Child>,
    watchdog: Option<Child>,
    port: u16,
    version: String,
}

impl Cluster {
    /// Initialises and starts a cluster. Blocks for a second or two (`initdb`
    /// and server start); call it from `spawn_blocking` on a busy runtime.
    pub fn start() -> Result<Cluster, ClusterError> {
        let binaries = Binaries::find()?;
        let run_as = RunAs::detect()?;

        let dir = tempfile::Builder::new()
            .prefix("pgonce-pg-")
            .tempdir()
            .map_err(io("creating the cluster directory"))?;
        run_as.chown(dir.path())?;
        let data = dir.path().join("data");

        let mut initdb = Command::new(binaries.tool("initdb"));
        initdb
            .arg("--pgdata")
            .arg(&data)
            .args(["--username", SUPERUSER, "--auth=trust", "--encoding=UTF8"])
            .args(["--locale=C", "--no-sync", "--no-instructions"])
            .current_dir(dir.path())
            .stdin(Stdio::null());
        run_as.apply(&mut initdb);
        let out = initdb.output().map_err(io("running initdb"))?;
        if !out.status.success() {
            return Err(ClusterError::Setup {
                step: "initdb",
                detail: format!("exited with {}", out.status),
                log: format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
        let version = std::fs::read_to_string(data.join("PG_VERSION"))
            .map(|v| v.trim().to_string())
            .unwrap_or_default();

        // A port found free may be taken before the server binds it; retry
        // with another port when the log says so.
        let mut last_err = None;
        for _ in 0..5 {
            let port = free_port()?;
            match start_server(&binaries, run_as, dir.path(), &data, port) {
                Ok(server) => {
                    let watchdog = spawn_watchdog(server.id(), dir.path())?;
                    tracing::info!(port, dir = %dir.path().display(), version, "started throwaway PostgreSQL");
                    return Ok(Cluster {
                        dir: Some(dir),
                        server: Some(server),
                        watchdog: Some(watchdog),
                        port,
                        version,
                    });
                }
                Err(e @ ClusterError::Setup { .. }) if e.to_string().contains("could not bind") => {
                    last_err = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last_err.expect("loop ran"))
    }

    /// The TCP port the server listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's major version, as `initdb` wrote it (`"15"`).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The cluster's directory (data directory, socket, log).
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("cluster is running").path()
    }

    /// A connection URL for `database` on this cluster, as the superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{database}", self.port)
    }

    /// Stops the server with `mode` and starts it again on the same port and
    /// data directory, as `pg_ctl restart -m <mode>` would: every session is
    /// cut off (sessions see SQLSTATE 57P01, or a closed connection), and new
    /// connections are refused until the server is ready again. Blocks until
    /// it is; call it from `spawn_blocking` on a busy runtime.
    pub fn restart(&mut self, mode: ShutdownMode) -> Result<(), ClusterError> {
        let dir = self
            .dir
            .as_ref()
            .expect("cluster is running")
            .path()
            .to_owned();
        // The watchdog holds the old server's pid: stop it first, so it can
        // never signal a reused pid, and start a new one for the new server.
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        if let Some(mut server) = self.server.take() {
            stop_server(&mut server, mode.signal());
        }
        let binaries = Binaries::find()?;
        let run_as = RunAs::detect()?;
        let server = start_server(&binaries, run_as, &dir, &dir.join("data"), self.port)?;
        self.watchdog = Some(spawn_watchdog(server.id(), &dir)?);
        self.server = Some(server);
        tracing::info!(port = self.port, ?mode, "restarted throwaway PostgreSQL");
        Ok(())
    }

    /// Stops the server (fast shutdown, then kill after 30 s) and removes the
    /// directory. Idempotent; `Drop` calls it too.
    pub fn stop(&mut self) {
        // The watchdog goes first, so it can never signal a reused pid.
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        if let Some(mut server) = self.server.take() {
            stop_server(&mut server, Signal::SIGINT);
            tracing::info!(port = self.port, "stopped throwaway PostgreSQL");
        }
        if let Some(dir) = self.dir.take() {
            let _ = dir.close();
        }
    }
}

/// How [`Cluster::restart`] stops the server (`pg_ctl -m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Waits for sessions to end (SIGTERM).
    Smart,
    /// Rolls back and disconnects every session (SIGINT): `pg_ctl -m fast`.
    Fast,
    /// Quits without a checkpoint; recovery runs at start (SIGQUIT).
    Immediate,
}

impl ShutdownMode {
    fn signal(self) -> Signal {
        match self {
            ShutdownMode::Smart => Signal::SIGTERM,
            ShutdownMode::Fast => Signal::SIGINT,
            ShutdownMode::Immediate => Signal::SIGQUIT,
        }
    }
}

/// Signals the server and waits for it to exit, killing it after
/// [`STOP_TIMEOUT`].
fn stop_server(server: &mut Child, signal: Signal) {
    stop_process(server, signal, STOP_TIMEOUT);
}

/// Sends `signal` to `process` and waits for it to exit; kills it once
/// `timeout` has passed.
pub(crate) fn stop_process(process: &mut Child, signal: Signal, timeout: Duration) {
    let _ = kill(Pid::from_raw(process.id() as i32), signal);
    let deadline = Instant::now() + timeout;
    loop {
        match process.try_wait() {
            Ok(Some(_)) | Err(_) => break,
            Ok(None) if Instant::now() >= deadline => {
                let _ = process.kill();
                let _ = process.wait();
                break;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

pub(crate) fn free_port() -> Result<u16, ClusterError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io("finding a free port"))?;
    Ok(listener
        .local_addr()
        .map_err(io("finding a free port"))?
        .port())
}

fn start_server(
    binaries: &Binaries,
    run_as: RunAs,
    dir: &Path,
    data: &Path,
    port: u16,
) -> Result<Child, ClusterError> {
    let log_path = dir.join("postgres.log");
    let log = File::create(&log_path).map_err(io("creating the server log"))?;
    let log_err = log.try_clone().map_err(io("creating the server log"))?;
    let mut cmd = Command::new(binaries.tool("postgres"));
    cmd.arg("-D")
        .arg(data)
        .arg("-p")
        .arg(port.to_string())
        .arg("-k")
        .arg(dir)
        .args(["-c", "listen_addresses=127.0.0.1"])
        .args(["-c", "max_connections=300"])
        .args(["-c", "shared_buffers=256MB"])
        .args(["-c", "max_locks_per_transaction=256"])
        .args(["-c", "fsync=on"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        // Its own process group: a Ctrl-C in the terminal reaches us, and we
        // decide how the server stops.
        .process_group(0);
    run_as.apply(&mut cmd);
    let mut server = cmd.spawn().map_err(io("starting postgres"))?;

    // Ready when postmaster.pid's status line says so (what pg_ctl waits for).
    let pid_file = data.join("postmaster.pid");
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(Some(status)) = server.try_wait() {
            return Err(ClusterError::Setup {
                step: "starting postgres",
                detail: format!("the server exited with {status}"),
                log: read_log(&log_path),
            });
        }
        if let Ok(contents) = std::fs::read_to_string(&pid_file)
            && contents.lines().nth(7).is_some_and(|l| l.trim() == "ready")
        {
            return Ok(server);
        }
        if Instant::now() >= deadline {
            let _ = server.kill();
            let _ = server.wait();
            return Err(ClusterError::Setup {
                step: "starting postgres",
                detail: format!("not ready within {START_TIMEOUT:?}"),
                log: read_log(&log_path),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn read_log(path: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_string(&mut s);
    }
    s
}

/// Starts the watchdog described in the module docs. It waits for EOF on its
/// stdin, then stops the server and removes the directory.
pub(crate) fn spawn_watchdog(server_pid: u32, dir: &Path) -> Result<Child, ClusterError> {
    const SCRIPT: &str = r#"
read -r _ignored
kill -INT "$1" 2>/dev/null
i=0
while kill -0 "$1" 2>/dev/null && [ "$i" -lt 300 ]; do sleep 0.1; i=$((i+1)); done
kill -KILL "$1" 2>/dev/null
rm -rf -- "$2"
"#;
    Command::new("sh")
        .arg("-c")
        .arg(SCRIPT)
        .arg("pgonce-pg-watchdog")
        .arg(server_pid.to_string())
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(io("starting the cluster watchdog"))
}
