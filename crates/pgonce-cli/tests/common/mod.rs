//! What the CLI's tests share: a fresh database's URL, a free port,
//! plain HTTP probes of a child process's endpoints, a session seen
//! blocked, and a child's stderr read as it comes.
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// A URL for a fresh test database (the shared test server, or the
/// DATABASE_URL server with the database name swapped).
pub fn fresh_database_url() -> (
    tokio::runtime::Runtime,
    pgonce_testkit::ScratchDatabase,
    String,
) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt.block_on(pgonce_testkit::fresh_database());
    let url = match std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        Some(base) => {
            let (head, query) = base.split_once('?').unwrap_or((&base, ""));
            let head = head.rsplit_once('/').map_or(head, |(h, _)| h);
            let query = if query.is_empty() {
                String::new()
            } else {
                format!("?{query}")
            };
            format!("{head}/{}{query}", db.name())
        }
        None => {
            let o = db.options();
            format!(
                "postgres://{}@{}:{}/{}",
                o.get_username(),
                o.get_host(),
                o.get_port(),
                db.name()
            )
        }
    };
    (rt, db, url)
}

/// A free local port (bound, then released for the child to take).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET path` on the local port, the whole HTTP/1.1 answer, if any.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Waits until `GET path` on `port` answers 200 (migrations done, pool
/// up) and returns the answer; the child must not exit meanwhile.
pub fn wait_for_200(child: &mut std::process::Child, port: u16, path: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(a) = http_get(port, path).filter(|a| a.starts_with("HTTP/1.1 200")) {
            return a;
        }
        assert!(Instant::now() < deadline, "{path} never answered 200");
        assert!(child.try_wait().unwrap().is_none(), "exited early");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A child process killed (SIGKILL) and reaped when dropped, so a failing
/// assertion leaves no `pgonce` running.
pub struct Reaped(pub std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The backend of the one session on `pool`'s database, other than the
/// caller's, that waits for a lock the session `holder` holds: a `pgonce`
/// process's, seen blocked. Polls the catalog, never the clock (the
/// deadline only ends a stuck run).
pub fn blocked_backend(rt: &tokio::runtime::Runtime, pool: &sqlx::PgPool, holder: i32) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let blocked: Option<i32> = rt
            .block_on(
                sqlx::query_scalar(
                    "SELECT pid FROM pg_stat_activity \
                     WHERE datname = current_database() AND $1 = ANY(pg_blocking_pids(pid))",
                )
                .bind(holder)
                .fetch_optional(pool),
            )
            .unwrap();
        if let Some(pid) = blocked {
            return pid;
        }
        assert!(Instant::now() < deadline, "no session ever blocked");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A transaction open on `pool`, to take the locks a test holds a
/// `pgonce` process on, and its backend, which that process is then seen
/// blocked by ([`blocked_backend`]).
pub fn open_gate(
    rt: &tokio::runtime::Runtime,
    pool: &sqlx::PgPool,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, i32) {
    let mut gate = rt.block_on(pool.begin()).unwrap();
    let holder: i32 = rt
        .block_on(sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *gate))
        .unwrap();
    (gate, holder)
}

/// Asserts that the database holds no table: no command migrated it.
pub fn assert_never_migrated(rt: &tokio::runtime::Runtime, db: &pgonce_testkit::ScratchDatabase) {
    let pool = rt.block_on(db.pool(1)).unwrap();
    let tables: i64 = rt
        .block_on(
            sqlx::query_scalar(
                "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')",
            )
            .fetch_one(&pool),
        )
        .unwrap();
    assert_eq!(tables, 0, "the database was migrated");
}

/// A `pgonce` process's stderr, line by line, as it comes.
pub struct Stderr(pub std::sync::mpsc::Receiver<String>);

impl Stderr {
    pub fn of(child: &mut std::process::Child) -> Stderr {
        use std::io::BufRead;
        let (lines, rx) = std::sync::mpsc::channel();
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        Stderr(rx)
    }

    /// Waits for a line containing `needle` (the lines before it are
    /// kept in `seen`); panics past 180 s, or if the process closed stderr
    /// (it exited) first.
    pub fn wait_for(&self, needle: &str, seen: &mut Vec<String>) {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.0.recv_timeout(left) {
                Ok(line) => {
                    let found = line.contains(needle);
                    seen.push(line);
                    if found {
                        return;
                    }
                }
                Err(e) => panic!("no line with {needle:?} ({e}):\n{}", seen.join("\n")),
            }
        }
    }
}
