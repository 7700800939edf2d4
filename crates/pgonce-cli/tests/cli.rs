//! The `pgonce` binary as a user runs it.

use std::time::{Duration, Instant};

use assert_cmd::Command;
use pgonce_testkit::{FaultProxy, NewConnections};

mod common;

use common::{
    Reaped, Stderr, assert_never_migrated, blocked_backend, free_port, fresh_database_url,
    http_get, open_gate, wait_for_200,
};

fn pgonce() -> Command {
    let mut cmd = Command::cargo_bin("pgonce").unwrap();
    cmd.env_remove("DATABASE_URL").env("RUST_LOG", "warn");
    cmd
}

#[test]
fn migrate_against_a_closed_port_fails_fast_with_one_line_naming_the_address() {
    let started = Instant::now();
    let out = pgonce()
        .env("DATABASE_URL", "postgres://127.0.0.1:1/x")
        .arg("migrate")
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("127.0.0.1:1/x"), "{stderr}");
}

/// A database slower to connect to than the first connection's 5 s
/// bound (a distant server, TLS, a slow login, a loaded machine) is
/// migrated when `database.acquire_timeout` allows for it: the first
/// connection is waited for as long as the pool's are. Driven through a
/// proxy that answers each new connection 6 s late. The check gave up at
/// 5 s whatever the acquire timeout said: the command exited 1, and each
/// start a service manager made gave up the same way, so none ever got a
/// connection.
#[test]
fn a_database_slower_to_connect_to_than_five_seconds_is_reached_within_the_acquire_timeout() {
    let (rt, db, url) = fresh_database_url();
    let late = NewConnections::ForwardLate(Duration::from_secs(6));
    let proxy = rt.block_on(FaultProxy::start(db.options(), late)).unwrap();
    let out = pgonce()
        .env("DATABASE_URL", url_through(&url, &proxy))
        .env("PGONCE_DATABASE__ACQUIRE_TIMEOUT", "60s")
        .arg("migrate")
        .timeout(Duration::from_secs(120))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("migrations applied"), "{stderr}");
}

/// `url` with its host and port replaced by `proxy`'s.
fn url_through(url: &str, proxy: &FaultProxy) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, path) = rest.split_once('/').unwrap();
    let user = authority.rsplit_once('@').map_or("", |(user, _)| user);
    let at = if user.is_empty() { "" } else { "@" };
    format!("{scheme}://{user}{at}{}/{path}", proxy.address())
}

/// `worker` and `serve` started with the database down do not wait for it:
/// they exit 1 at once with one line naming its address (a service
/// manager restarts them), their address, bound first, released on exit.
#[test]
fn worker_and_serve_with_the_database_down_exit_1_in_one_line_naming_it() {
    for command in ["worker", "serve"] {
        let port = free_port();
        let out = pgonce()
            .args([command, "--database-url", "postgres://127.0.0.1:1/down"])
            .env("PGONCE_API__LISTEN", format!("127.0.0.1:{port}"))
            .env("PGONCE_API__METRICS_LISTEN", format!("127.0.0.1:{port}"))
            .timeout(Duration::from_secs(30))
            .output()
            .unwrap();
        let line = the_one_line_of_exit_1(command, &out);
        assert!(
            line.contains("cannot connect to PostgreSQL at 127.0.0.1:1/down"),
            "{command}: {line}"
        );
    }
}

/// With both `database.url` and `database.direct_url` set, a URL that
/// cannot connect (here a database that does not exist; a wrong password
/// is refused the same way) is named by its key, so that an operator
/// knows which of the two to fix: the line named only the address.
#[test]
fn a_database_url_that_cannot_connect_is_named_by_its_key() {
    let (_rt, _db, url) = fresh_database_url();
    let (head, _) = url.rsplit_once('/').unwrap();
    let missing = format!("{head}/pgonce_no_such_database");
    for (key, database_url, direct_url) in [
        ("database.direct_url", url.as_str(), missing.as_str()),
        ("database.url", missing.as_str(), url.as_str()),
    ] {
        let out = pgonce()
            .arg("worker")
            .env("PGONCE_DATABASE__URL", database_url)
            .env("PGONCE_DATABASE__DIRECT_URL", direct_url)
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let line = the_one_line_of_exit_1("worker", &out);
        assert!(
            line.starts_with(&format!(
                "pgonce: error: {key}: cannot connect to PostgreSQL at "
            )) && line.contains("pgonce_no_such_database"),
            "{key}: {line}"
        );
    }
}

/// The one line `command` printed on stderr, having exited 1.
fn the_one_line_of_exit_1(command: &str, out: &std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{command}: {stderr}");
    let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{command}: {stderr}");
    lines[0].to_owned()
}

/// A variable in the environment whose value is not UTF-8 does not crash
/// `serve`, `worker` or `rollout` (`std::env::vars` would panic on it): one
/// that is not the service's is left out, and the
/// command goes on to its real error here, no database; one of the
/// service's own is refused, named.
#[test]
fn a_variable_that_is_not_utf8_is_left_out_or_named_never_a_panic() {
    use std::os::unix::ffi::OsStrExt;
    let not_utf8 = std::ffi::OsStr::from_bytes(b"\xff");
    for command in ["serve", "worker", "rollout"] {
        let out = pgonce()
            .arg(command)
            .env("JUNK", not_utf8)
            .timeout(Duration::from_secs(20))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command}: {stderr}");
        assert!(!stderr.contains("panicked"), "{command}: {stderr}");
        assert!(stderr.contains("database"), "{command}: {stderr}");
        let out = pgonce()
            .arg(command)
            .env("PGONCE_API__ADMIN_TOKEN", not_utf8)
            .timeout(Duration::from_secs(20))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command}: {stderr}");
        assert!(
            stderr.contains("PGONCE_API__ADMIN_TOKEN"),
            "{command}: {stderr}"
        );
    }
}

/// `rollout` takes a percentage, 0 to 100, and refuses another before it
/// touches the database (neither migrates nor connects); a directory given
/// as `--config` is refused as not a file, named.
#[test]
fn rollout_and_config_refuse_what_cannot_be_before_touching_the_database() {
    let (rt, db, url) = common::fresh_database_url();
    for percent in ["101", "255", "-1"] {
        let out = pgonce()
            .args(["rollout", "--database-url", &url, percent])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{percent}");
    }
    assert_never_migrated(&rt, &db);
    let dir = std::env::temp_dir();
    let out = pgonce()
        .args(["worker", "--database-url", &url, "--config"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not a file"), "{stderr}");
    assert!(stderr.contains(&*dir.to_string_lossy()), "{stderr}");
}

#[test]
fn migrate_without_a_database_says_what_to_pass() {
    let out = pgonce().arg("migrate").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--database-url"));
}

/// Records `version` applied on `pool`'s database, as a newer build's
/// migration would be.
fn record_newer_migration(rt: &tokio::runtime::Runtime, pool: &sqlx::PgPool, version: i64) {
    rt.block_on(
        sqlx::query(
            "INSERT INTO _sqlx_migrations \
             (version, description, success, checksum, execution_time) \
             VALUES ($1, 'from a newer build', true, '\\x00', 0)",
        )
        .bind(version)
        .execute(pool),
    )
    .unwrap();
}

/// A database a newer build migrated is refused, by `migrate` and by
/// `serve`, in words that say so, with nothing applied: one unknown
/// version in pgonce's range, then one in the service's.
#[test]
fn a_database_a_newer_build_migrated_is_refused_in_words_that_say_so() {
    let (rt, db, url) = fresh_database_url();
    let pool = rt.block_on(db.pool(1)).unwrap();
    let newer = |version: i64| record_newer_migration(&rt, &pool, version);
    let applied = || -> i64 {
        rt.block_on(sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations").fetch_one(&pool))
            .unwrap()
    };
    let migrate = pgonce()
        .arg("migrate")
        .env("DATABASE_URL", &url)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert!(migrate.status.success(), "{migrate:?}");
    let before = applied();

    newer(998);
    let refused = pgonce()
        .arg("migrate")
        .env("DATABASE_URL", &url)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("migration 998") && stderr.contains("a newer pgonce migrated it"),
        "{stderr}"
    );

    rt.block_on(sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 998").execute(&pool))
        .unwrap();
    newer(1998);
    let port = free_port();
    let serve = pgonce()
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &url)
        .env("PGONCE_ADMIN_TOKEN", "cli-test-admin-token-000")
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert!(!serve.status.success());
    let stderr = String::from_utf8_lossy(&serve.stderr);
    assert!(stderr.contains("migration 1998"), "{stderr}");
    // pgonce's migrations were all there; the service's none was run.
    assert_eq!(applied(), before + 1);
}

/// Sends SIGTERM and expects exit 0 within 30 s, having said it stopped;
/// returns its stderr.
fn sigterm_then_exit_0(mut child: std::process::Child) -> String {
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(stderr.contains("stopped"), "{stderr}");
    stderr
}

#[test]
fn serve_answers_then_drains_and_exits_0_on_sigterm() {
    let (_rt, _db, url) = fresh_database_url();
    let port = free_port();
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("pgonce"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &url)
        .env("PGONCE_ADMIN_TOKEN", "cli-test-admin-token-000")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ready = wait_for_200(&mut child, port, "/readyz");
    assert!(ready.contains("ready"), "{ready}");
    sigterm_then_exit_0(child);
}

/// `pgonce worker` has no API, but its metrics can be scraped and its
/// readiness probed on `metrics_listen`.
#[test]
fn worker_serves_metrics_and_readiness_on_metrics_listen() {
    let (rt, db, url) = fresh_database_url();
    let port = free_port();
    let mut child = ready_worker(&url, port, &[]);
    // One message for the worker to receive (malformed: it fails, and is
    // retried, which is all this needs), then its counter in the scrape.
    rt.block_on(async {
        use pgonce::Queue;
        let pool = db.pool(2).await.unwrap();
        let queue =
            pgonce_incidents::runtime::observations_queue(&pool, Duration::from_secs(30), 5)
                .await
                .unwrap();
        queue
            .send(pgonce::SendMessage::new("not an observation").group("cli-test"))
            .await
            .unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = wait_for_200(&mut child, port, "/metrics");
        if metrics.contains("pgonce_queue_worker_received_total") {
            break;
        }
        assert!(Instant::now() < deadline, "no worker metric: {metrics}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let api = http_get(port, "/v1/incidents").unwrap_or_default();
    assert!(api.starts_with("HTTP/1.1 404"), "no API here: {api}");
    sigterm_then_exit_0(child);
}

/// A `pgonce worker` on `url` with the variables `vars`, its metrics on
/// `port` (the flat `PGONCE_METRICS_LISTEN`), once `/readyz` answers 200.
/// Its stderr is piped.
fn ready_worker(url: &str, port: u16, vars: &[(&str, &str)]) -> std::process::Child {
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("pgonce"))
        .arg("worker")
        .env("DATABASE_URL", url)
        .env("PGONCE_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .envs(vars.iter().copied())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_200(&mut child, port, "/readyz");
    child
}

#[test]
fn serve_with_an_unknown_config_key_fails_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pgonce.toml");
    std::fs::write(&path, "wokers = 2\n").unwrap();
    let out = pgonce()
        .args(["serve", "--config", path.to_str().unwrap()])
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("wokers"));
}

/// Whether `pool`'s database holds the library's schema.
fn migrated(rt: &tokio::runtime::Runtime, pool: &sqlx::PgPool) -> bool {
    rt.block_on(sqlx::query_scalar("SELECT to_regnamespace('pgonce') IS NOT NULL").fetch_one(pool))
        .unwrap()
}

/// `migrate` reads the configuration `serve` and `worker` read: the file
/// (`--config`), `PGONCE_DATABASE__URL` over `DATABASE_URL`, and migrates
/// over `database.direct_url` when set, as they do; a bad key in that
/// configuration is refused naming it, nothing applied. It took no
/// `--config` (a usage error), read `DATABASE_URL` alone and ran on
/// `database.url` (here a closed port), so an operator's one configuration
/// did not reach it.
#[test]
fn migrate_reads_the_configuration_serve_reads() {
    let (rt, db, url) = fresh_database_url();
    let pool = rt.block_on(db.pool(1)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pgonce.toml");
    let migrate_with_file = |database_section: String| {
        std::fs::write(&path, format!("[database]\n{database_section}")).unwrap();
        let out = pgonce()
            .args(["migrate", "--config", path.to_str().unwrap()])
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    // A bad key: refused naming it, before anything is applied.
    let (code, stderr) = migrate_with_file(format!("url = {url:?}\nmax_connections = 0\n"));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("database.max_connections"), "{stderr}");
    assert!(!migrated(&rt, &pool));

    // `url` a closed port (a pooler not up yet), `direct_url` the database:
    // the migrations go over the direct URL, as `serve`'s do.
    let closed = format!("postgres://nobody@127.0.0.1:{}/nowhere", free_port());
    let (code, stderr) = migrate_with_file(format!("url = {closed:?}\ndirect_url = {url:?}\n"));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(migrated(&rt, &pool), "{stderr}");

    // The environment alone: PGONCE_DATABASE__URL over DATABASE_URL.
    let (rt2, db2, url2) = fresh_database_url();
    let pool2 = rt2.block_on(db2.pool(1)).unwrap();
    let out = pgonce()
        .arg("migrate")
        .env("PGONCE_DATABASE__URL", &url2)
        .env("DATABASE_URL", &closed)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(migrated(&rt2, &pool2), "{stderr}");
}

/// A value of the wrong type in the file is refused naming the key as the
/// file writes it, and the file, nothing applied. figment put its profile
/// before the key: `for key "default.database.max_connections"`, a key no
/// file has.
#[test]
fn a_file_value_of_the_wrong_type_names_the_key_as_the_file_writes_it() {
    let (rt, db, url) = fresh_database_url();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pgonce.toml");
    std::fs::write(
        &path,
        format!("[database]\nurl = {url:?}\nmax_connections = \"16\"\n"),
    )
    .unwrap();
    let out = pgonce()
        .args(["migrate", "--config", path.to_str().unwrap()])
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("for key \"database.max_connections\""),
        "{stderr}"
    );
    assert!(stderr.contains("pgonce.toml"), "{stderr}");
    assert_never_migrated(&rt, &db);
}

/// A configuration file that exists but cannot be read (here one whose
/// read fails, `/proc/self/mem`, as a file without read permission does
/// for a user who is not root), or is not UTF-8, is refused as the file
/// named with why, nothing applied: the read's error came out of figment
/// as `Input/output error (os error 5)  in /proc/self/mem TOML file`,
/// neither saying it was the configuration file nor naming it first.
#[test]
fn a_configuration_file_that_cannot_be_read_is_named_with_why() {
    let (rt, db, url) = fresh_database_url();
    let dir = tempfile::tempdir().unwrap();
    let not_utf8 = dir.path().join("latin1.toml");
    std::fs::write(
        &not_utf8,
        b"[api]\nadmin_token = \"caf\xe9caf\xe9caf\xe9caf\xe9\"\n",
    )
    .unwrap();
    for (path, why) in [
        (
            std::path::PathBuf::from("/proc/self/mem"),
            "Input/output error",
        ),
        (not_utf8, "valid UTF-8"),
    ] {
        let out = pgonce()
            .args(["migrate", "--config", path.to_str().unwrap()])
            .env("DATABASE_URL", &url)
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let line = the_one_line_of_exit_1("migrate", &out);
        assert!(
            line.starts_with(&format!(
                "pgonce: error: configuration file {}: ",
                path.display()
            )) && line.contains(why),
            "{line}"
        );
        assert_never_migrated(&rt, &db);
    }
}

/// A `database.url` or `database.direct_url` that is not a PostgreSQL URL
/// is refused with the rest of the configuration, naming its key, nothing
/// applied: a `mysql://` URL was parsed as PostgreSQL's and migrated the
/// PostgreSQL on its host and port, and text that is no URL was refused
/// without the key that held it.
#[test]
fn a_database_url_that_is_not_postgresqls_is_refused_naming_its_key() {
    let (rt, db, url) = fresh_database_url();
    let (_, rest) = url.split_once("://").unwrap();
    let other_scheme = format!("mysql://{rest}");
    for (variable, key, value) in [
        (
            "PGONCE_DATABASE__URL",
            "database.url",
            other_scheme.as_str(),
        ),
        ("PGONCE_DATABASE__URL", "database.url", "not a url"),
        (
            "PGONCE_DATABASE__DIRECT_URL",
            "database.direct_url",
            other_scheme.as_str(),
        ),
    ] {
        let out = pgonce()
            .arg("migrate")
            .env("DATABASE_URL", &url)
            .env(variable, value)
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{variable}={value}: {stderr}");
        assert!(
            stderr.contains(&format!("{key}: not a PostgreSQL URL")),
            "{variable}={value}: {stderr}"
        );
        assert_never_migrated(&rt, &db);
    }
}

/// A PostgreSQL URL sqlx cannot parse is refused naming its key, in
/// sqlx's words once, nothing applied: a bad query parameter read
/// `not a PostgreSQL URL: error with configuration: error with
/// configuration: unknown value "bogus" for `ssl_mode``, sqlx's wrapper
/// twice around the reason.
#[test]
fn a_database_url_sqlx_cannot_parse_is_refused_with_its_reason_once() {
    let (rt, db, url) = fresh_database_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    let bad_port = format!("postgres://127.0.0.1:x/{}", db.name());
    for (value, reason) in [
        (
            format!("{url}{separator}sslmode=bogus"),
            "unknown value \"bogus\" for `ssl_mode`",
        ),
        (bad_port, "invalid port number"),
    ] {
        let out = pgonce()
            .arg("migrate")
            .env("PGONCE_DATABASE__URL", &value)
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(
            stderr.trim(),
            format!("pgonce: error: database.url: not a PostgreSQL URL: {reason}"),
        );
        assert_never_migrated(&rt, &db);
    }
}

/// `--database-url` typed on the command line names the database a
/// command uses, direct sessions included: a `database.direct_url` left in
/// the environment (or the file) for the configured database is set aside
/// with it. `migrate --database-url A` migrated the direct URL's database
/// B and left A as it was, saying it had migrated B.
#[test]
fn database_url_typed_sets_the_configurations_direct_url_aside() {
    let (rt, typed_db, typed) = fresh_database_url();
    let (rt2, direct_db, direct) = fresh_database_url();
    let typed_pool = rt.block_on(typed_db.pool(1)).unwrap();
    let out = pgonce()
        .args(["migrate", "--database-url", &typed])
        .env("PGONCE_DATABASE__DIRECT_URL", &direct)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains(typed_db.name()), "{stderr}");
    assert!(migrated(&rt, &typed_pool), "{stderr}");
    assert_never_migrated(&rt2, &direct_db);
}

/// The one line `pgonce migrate` prints for a database error: PostgreSQL's
/// message once, its SQLSTATE, no C source line of the server.
fn assert_printed_once(stderr: &str, message: &str) {
    let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert_eq!(lines[0].matches(message).count(), 1, "{stderr}");
    assert!(!lines[0].contains(" at line "), "{stderr}");
    assert!(lines[0].contains("SQLSTATE"), "{stderr}");
}

#[test]
fn migrate_prints_a_database_error_once() {
    let (rt, db, url) = fresh_database_url();
    // A database that does not exist: refused while connecting.
    let (head, _) = url.rsplit_once('/').unwrap();
    let out = pgonce()
        .env("DATABASE_URL", format!("{head}/pgonce_no_such_database"))
        .arg("migrate")
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_printed_once(&stderr, "\"pgonce_no_such_database\" does not exist");

    // A user without the right to create the schema: refused mid-migration.
    rt.block_on(async {
        let pool = db.pool(1).await.unwrap();
        sqlx::query("DROP ROLE IF EXISTS pgonce_no_rights")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("CREATE ROLE pgonce_no_rights LOGIN PASSWORD 'no-rights-pw'")
            .execute(&pool)
            .await
            .unwrap();
    });
    let no_rights = as_role(&db, "pgonce_no_rights", "no-rights-pw");
    let out = pgonce()
        .env("DATABASE_URL", &no_rights)
        .arg("migrate")
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_printed_once(&stderr, "permission denied");
}

/// `rollout` reads the same configuration as `serve` and refuses a bad
/// value in it the same way, naming the key, before it connects: a zero
/// `database.acquire_timeout` was taken, and every connection then "timed
/// out" as if the database were down; a `database.direct_url` that is not a
/// URL was reported without the key that held it. Nothing is written.
#[test]
fn rollout_refuses_a_bad_database_setting_naming_its_key_before_connecting() {
    let (rt, db, url) = fresh_database_url();
    for (variable, value, key) in [
        (
            "PGONCE_DATABASE__ACQUIRE_TIMEOUT",
            "0s",
            "database.acquire_timeout",
        ),
        (
            "PGONCE_DATABASE__DIRECT_URL",
            "not a url",
            "database.direct_url",
        ),
        (
            "PGONCE_DATABASE__MAX_CONNECTIONS",
            "1",
            "database.max_connections",
        ),
    ] {
        for percent in [None, Some("50")] {
            let out = pgonce()
                .args(["rollout", "--database-url", &url])
                .args(percent)
                .env(variable, value)
                .timeout(Duration::from_secs(20))
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{variable}={value}: {stderr}");
            assert!(stderr.contains(key), "{variable}={value}: {stderr}");
            assert!(out.stdout.is_empty(), "{variable}={value}: {stderr}");
        }
    }
    assert_never_migrated(&rt, &db);
}

/// A schema dropped by hand, in part or whole, after its migrations ran is
/// refused by `migrate` and by `worker`, naming what is missing, instead of
/// "migrations applied" (the bookkeeping rows still say so) and a worker
/// whose every receive then fails on a relation that does not exist.
#[test]
fn a_schema_half_dropped_by_hand_is_refused_naming_what_is_missing() {
    let (rt, db, url) = fresh_database_url();
    let pool = rt.block_on(db.pool(1)).unwrap();
    let migrate = || {
        pgonce()
            .arg("migrate")
            .env("DATABASE_URL", &url)
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap()
    };
    let first = migrate();
    assert!(first.status.success(), "{first:?}");
    let drop = |sql: &str| {
        rt.block_on(sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool))
            .unwrap();
    };

    drop("DROP TABLE pgonce.queue_message CASCADE");
    let out = migrate();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("pgonce.queue_message"), "{stderr}");
    let worker = pgonce()
        .args(["worker", "--database-url", &url])
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&worker.stderr);
    assert_eq!(worker.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("pgonce.queue_message"), "{stderr}");
    assert!(!stderr.contains("runtime started"), "{stderr}");

    drop("DROP FUNCTION pgonce.lock_key(text, text) CASCADE");
    let out = migrate();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("pgonce.lock_key"), "{stderr}");

    drop("DROP SCHEMA pgonce CASCADE");
    let out = migrate();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("schema pgonce"), "{stderr}");
}

/// A `pgonce` process seen blocked inside its first migration (its SQL
/// run, its bookkeeping row not yet written), by the lock `gate` holds.
struct Held {
    gate: sqlx::Transaction<'static, sqlx::Postgres>,
    child: Reaped,
    /// The process's blocked backend.
    backend: i32,
}

/// Starts `pgonce migrate` on `url`, `pool`'s database, and returns it
/// [`Held`]. Its stderr is piped.
fn migrate_held_mid_migration(
    rt: &tokio::runtime::Runtime,
    pool: &sqlx::PgPool,
    url: &str,
) -> Held {
    held_mid_migration(rt, pool, url, "migrate")
}

/// Starts `pgonce COMMAND` (`migrate`, `serve`, `worker`: each migrates
/// first) on `url`, `pool`'s database, and returns it [`Held`]. Its stderr
/// is piped; `serve` listens on a free port.
fn held_mid_migration(
    rt: &tokio::runtime::Runtime,
    pool: &sqlx::PgPool,
    url: &str,
    command: &str,
) -> Held {
    // The runner's own bookkeeping table, made ahead so that the test can
    // lock it: a SHARE lock lets the runner read it and stops its INSERT.
    rt.block_on(
        sqlx::query(
            "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, \
             description TEXT NOT NULL, installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), \
             success BOOLEAN NOT NULL, checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL)",
        )
        .execute(pool),
    )
    .unwrap();
    let (mut gate, holder) = open_gate(rt, pool);
    rt.block_on(sqlx::query("LOCK TABLE _sqlx_migrations IN SHARE MODE").execute(&mut *gate))
        .unwrap();
    let child = Reaped(
        std::process::Command::new(assert_cmd::cargo::cargo_bin("pgonce"))
            .arg(command)
            .env("DATABASE_URL", url)
            .env("PGONCE_API__LISTEN", format!("127.0.0.1:{}", free_port()))
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let backend = blocked_backend(rt, pool, holder);
    Held {
        gate,
        child,
        backend,
    }
}

/// What a killed `migrate` left: bookkeeping rows, and whether the
/// `pgonce` schema exists.
#[derive(Debug, PartialEq, Eq, sqlx::FromRow)]
struct Left {
    rows: i64,
    schema: bool,
}

/// Waits for `backend`, a stopped process's blocked in its first
/// migration, to end (the gate released: it finds its client gone once it
/// goes on, and rolls back as it ends), then asserts that nothing of the
/// migration stayed: no bookkeeping row, no schema.
fn assert_nothing_of_the_migration_left(
    rt: &tokio::runtime::Runtime,
    pool: &sqlx::PgPool,
    backend: i32,
) {
    wait_until_ended(rt, pool, backend);
    let left: Left = rt
        .block_on(
            sqlx::query_as(
                "SELECT (SELECT count(*) FROM _sqlx_migrations) AS rows, \
                 to_regnamespace('pgonce') IS NOT NULL AS schema",
            )
            .fetch_one(pool),
        )
        .unwrap();
    assert_eq!(
        left,
        Left {
            rows: 0,
            schema: false
        },
        "half a migration stayed"
    );
}

/// `pgonce migrate` killed (SIGKILL) inside a migration, its SQL run and
/// its bookkeeping row waiting on a lock: nothing of that migration stays
/// (no schema, no row), and the next `migrate` applies everything and
/// succeeds.
#[test]
fn migrate_killed_mid_migration_leaves_nothing_and_runs_again() {
    let (rt, db, url) = fresh_database_url();
    // Failed assertions drop the held transaction, which needs the runtime.
    let _runtime = rt.enter();
    let pool = rt.block_on(db.pool(2)).unwrap();
    let Held {
        gate,
        mut child,
        backend,
    } = migrate_held_mid_migration(&rt, &pool, &url);
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    rt.block_on(gate.rollback()).unwrap();
    assert_nothing_of_the_migration_left(&rt, &pool, backend);

    let again = pgonce()
        .arg("migrate")
        .env("DATABASE_URL", &url)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert!(again.status.success(), "{again:?}");
    let rows: i64 = rt
        .block_on(sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations").fetch_one(&pool))
        .unwrap();
    assert_eq!(rows as usize, pgonce::migrate::MIGRATOR.iter().count());
}

/// A `pipeline.max_receive_count` past what the PostgreSQL queue stores
/// (an int) is refused with the rest of the configuration, naming the key,
/// before the database is touched: it was found only when the queue was
/// opened, after the migrations had run, in words naming no key.
#[test]
fn worker_refuses_a_max_receive_count_the_queue_cannot_store_before_migrating() {
    worker_refused_before_migrating(
        &[("PGONCE_PIPELINE__MAX_RECEIVE_COUNT", "2147483648")],
        "pipeline.max_receive_count",
    );
}

/// A lock wait of 0 (no bound in PostgreSQL's `lock_timeout`) is refused
/// with the rest of the configuration, naming the key, before the database
/// is touched: it was refused only by `Service::new`, after the migrations
/// had run, as the guard's `lock_timeout`.
#[test]
fn worker_refuses_a_lock_wait_of_zero_before_migrating() {
    for key in ["entity_lock_timeout", "declaration_lock_timeout"] {
        let variable = format!("PGONCE_SERVICE__{}", key.to_uppercase());
        worker_refused_before_migrating(&[(&variable, "0s")], &format!("service.{key}"));
    }
}

/// A value the library's own checks refuse (the worker's receives, the
/// notifier, the API, the job maintenance passes) is refused naming the
/// key that holds it, before the database is touched. They were named by
/// section and in the library's words: `pipeline: invalid worker config:
/// ... max_messages is 1 to 1000` for `pipeline.batch`, `notifier: invalid
/// notifier config: lease must exceed timeout ...` for any of three keys.
#[test]
fn worker_names_the_key_of_a_value_the_librarys_checks_refuse() {
    let webhook = ("PGONCE_NOTIFIER__WEBHOOK_URL", "http://127.0.0.1:9/hook");
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("PGONCE_PIPELINE__BATCH", "1001")], "pipeline.batch"),
        (&[("PGONCE_PIPELINE__WAIT", "13h")], "pipeline.wait"),
        (
            &[("PGONCE_PIPELINE__VISIBILITY_TIMEOUT", "13h")],
            "pipeline.visibility_timeout",
        ),
        (&[("PGONCE_API__ADMIN_TOKEN", "short")], "api.admin_token"),
        (&[("PGONCE_API__BODY_LIMIT", "10")], "api.body_limit"),
        (
            &[("PGONCE_API__BODY_LIMIT", "18446744073709551615")],
            "api.body_limit",
        ),
        (&[("PGONCE_API__BODY_TIMEOUT", "0s")], "api.body_timeout"),
        (
            &[("PGONCE_NOTIFIER__WEBHOOK_URL", "http://")],
            "notifier.webhook_url",
        ),
        (
            &[webhook, ("PGONCE_NOTIFIER__BATCH", "0")],
            "notifier.batch",
        ),
        (&[webhook, ("PGONCE_NOTIFIER__IDLE", "0s")], "notifier.idle"),
        (
            &[webhook, ("PGONCE_NOTIFIER__LEASE", "1s")],
            "notifier.lease",
        ),
        (
            &[webhook, ("PGONCE_NOTIFIER__RETRY__MAX", "0s")],
            "notifier.retry.max",
        ),
        (
            &[webhook, ("PGONCE_NOTIFIER__RETRY__BASE", "0s")],
            "notifier.retry.base",
        ),
        (
            &[webhook, ("PGONCE_NOTIFIER__RETRY__JITTER", "2")],
            "notifier.retry.jitter",
        ),
        (
            &[("PGONCE_MAINTENANCE__REAPER__INTERVAL", "0s")],
            "maintenance.reaper.interval",
        ),
        (
            &[("PGONCE_MAINTENANCE__REDRIVER__BATCH_SIZE", "0")],
            "maintenance.redriver.batch_size",
        ),
    ];
    for (vars, key) in cases {
        worker_refused_before_migrating(vars, &format!("error: {key}: "));
    }
}

/// `[queue.sqs]`'s values the SQS client's checks refuse are refused
/// naming their key, before the database is touched: they were named
/// `queue.sqs: invalid SQS config: the operation timeout is 100 ms to 5
/// minutes`, the section and the client's words.
#[test]
fn worker_names_the_key_of_an_sqs_value_the_clients_checks_refuse() {
    let sqs = ("PGONCE_QUEUE__BACKEND", "sqs");
    let local = ("PGONCE_QUEUE__SQS__ENDPOINT_URL", "http://127.0.0.1:9");
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[sqs, local, ("PGONCE_QUEUE__SQS__OPERATION_TIMEOUT", "10ms")],
            "queue.sqs.operation_timeout",
        ),
        (
            &[sqs, local, ("PGONCE_QUEUE__SQS__OPERATION_TIMEOUT", "6m")],
            "queue.sqs.operation_timeout",
        ),
        (
            &[
                sqs,
                ("PGONCE_QUEUE__SQS__ENDPOINT_URL", "ftp://127.0.0.1:9"),
            ],
            "queue.sqs.endpoint_url",
        ),
    ];
    for (vars, key) in cases {
        worker_refused_before_migrating(vars, &format!("error: {key}: "));
    }
}

/// The service's configuration sets no `PGONCE_` name aside: the names the
/// test kit read for the server binaries and PgBouncer (now `PG_BINDIR`
/// and `PGBOUNCER_BIN`) are unknown keys like any other, refused naming the
/// variable before the database is touched. The configuration skipped
/// them by name, and a `worker` started with one ran on.
#[test]
fn worker_refuses_the_test_kits_former_variables_as_unknown_keys() {
    for variable in ["PGONCE_PG_BINDIR", "PGONCE_PGBOUNCER"] {
        worker_refused_before_migrating(&[(variable, "/usr/bin")], variable);
    }
}

/// Every `PGONCE_` variable the repository's scripts read (`scripts/`,
/// `.ci/`) is one the configuration takes: a shell that exported it for a
/// script runs `pgonce migrate`, and the tests' `pgonce serve` and
/// `pgonce worker`, with it set. `scripts/test` read its job count from
/// `PGONCE_TEST_JOBS` and unset it for its own run only, so the variable
/// exported in a shell stopped a plain `cargo test` of the CLI as an
/// unknown key.
#[test]
fn the_scripts_read_no_pgonce_variable_the_configuration_refuses() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut variables = std::collections::BTreeSet::new();
    for dir in ["scripts", ".ci"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            // A plain scan: a variable's name is PGONCE_ then capitals,
            // digits and underscores.
            for (at, _) in text.match_indices("PGONCE_") {
                let name: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                // Not the prefix alone, as a comment writes it.
                if name.len() > "PGONCE_".len() {
                    variables.insert(name);
                }
            }
        }
    }
    assert!(root.join("scripts/test").is_file());
    let (_rt, _db, url) = fresh_database_url();
    for variable in &variables {
        let out = pgonce()
            .args(["migrate", "--database-url", &url])
            .env(variable, "3")
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{variable}=3: {stderr}");
    }
}

/// Without the `sqs-tls` feature, a queue on real SQS (no plain-HTTP
/// endpoint) is refused before the database is touched, saying to build
/// `pgonce` with `--features sqs-tls`: it named only the library's `tls`
/// feature, which this command has no feature of that name for.
#[cfg(not(feature = "sqs-tls"))]
#[test]
fn worker_without_tls_refuses_real_sqs_saying_which_feature_to_build() {
    let stderr = worker_refused_before_migrating(
        &[
            ("PGONCE_QUEUE__BACKEND", "sqs"),
            ("PGONCE_QUEUE__SQS__QUEUE", "observations.fifo"),
            (
                "PGONCE_QUEUE__SQS__DEAD_LETTER_QUEUE",
                "observations-dead.fifo",
            ),
        ],
        "queue.sqs",
    );
    assert!(stderr.contains("--features sqs-tls"), "{stderr}");
}

/// Runs `pgonce worker` on a fresh database with the variables `vars`, and
/// asserts that it exits 1 naming `key`, the database left unmigrated;
/// returns its stderr.
fn worker_refused_before_migrating(vars: &[(&str, &str)], key: &str) -> String {
    let (rt, db, url) = fresh_database_url();
    let out = pgonce()
        .args(["worker", "--database-url", &url])
        .envs(vars.iter().copied())
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(key), "{stderr}");
    assert_never_migrated(&rt, &db);
    stderr
}

/// `pgonce migrate` stopped by SIGTERM mid-migration exits 143 saying it was
/// interrupted, and nothing else: it made no throwaway database, so it
/// does not claim to have removed one.
#[test]
fn migrate_interrupted_says_so_without_a_throwaway_database() {
    let (rt, db, url) = fresh_database_url();
    let _runtime = rt.enter();
    let pool = rt.block_on(db.pool(2)).unwrap();
    let Stopped { status, stderr, .. } =
        sigterm_held(&rt, migrate_held_mid_migration(&rt, &pool, &url));
    assert_eq!(status.code(), Some(143), "{stderr}");
    assert_eq!(stderr.trim(), "pgonce: interrupted (SIGTERM)");
}

/// A [`Held`] process after SIGTERM.
struct Stopped {
    status: std::process::ExitStatus,
    stderr: String,
    /// Its backend, which was blocked.
    backend: i32,
}

/// Sends SIGTERM to `child`, whose stderr is piped, and waits for it to
/// end; returns how it ended and what it wrote.
fn sigterm_and_wait(child: &mut std::process::Child) -> (std::process::ExitStatus, String) {
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    (status, stderr)
}

/// Sends SIGTERM to `held`'s process, waits for it to end, then releases
/// the gate.
fn sigterm_held(rt: &tokio::runtime::Runtime, held: Held) -> Stopped {
    let Held {
        gate,
        mut child,
        backend,
    } = held;
    let (status, stderr) = sigterm_and_wait(&mut child.0);
    rt.block_on(gate.rollback()).unwrap();
    Stopped {
        status,
        stderr,
        backend,
    }
}

/// `serve` and `worker` stopped by SIGTERM while still starting (held
/// inside their first migration by a lock, seen blocked) exit 143 with one
/// line saying they were interrupted, as every other command does, and
/// nothing of the migration stays. They had no handler yet: the signal's
/// default disposition killed them, with no word and no exit code.
#[test]
fn serve_and_worker_interrupted_while_starting_exit_143_in_one_line() {
    for command in ["serve", "worker"] {
        let (rt, db, url) = fresh_database_url();
        let _runtime = rt.enter();
        let pool = rt.block_on(db.pool(2)).unwrap();
        let Stopped {
            status,
            stderr,
            backend,
        } = sigterm_held(&rt, held_mid_migration(&rt, &pool, &url, command));
        assert_eq!(status.code(), Some(143), "{command}: {status:?} {stderr}");
        assert_eq!(stderr.trim(), "pgonce: interrupted (SIGTERM)", "{command}");
        assert_nothing_of_the_migration_left(&rt, &pool, backend);
    }
}

/// `rollout` without a percent only reads. On a fresh database it says
/// the database is not migrated and leaves it without a table; on a
/// session that may not write (`default_transaction_read_only`, as on a
/// standby or for a read-only role) it prints the value `rollout PERCENT`
/// set. It migrated first: it made the schema of the fresh database, and
/// failed on the read-only session.
#[test]
fn rollout_without_a_percent_only_reads() {
    let (rt, db, url) = fresh_database_url();
    let read = |url: &str| {
        pgonce()
            .args(["rollout", "--database-url", url])
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap()
    };
    let out = read(&url);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not migrated"), "{stderr}");
    assert!(out.stdout.is_empty(), "{stderr}");
    assert_never_migrated(&rt, &db);

    set_rollout_30(&url);

    let separator = if url.contains('?') { '&' } else { '?' };
    let read_only = format!("{url}{separator}options=-c%20default_transaction_read_only%3Don");
    let out = read(&read_only);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "guard rollout: 30%\n");
}

/// `pgonce rollout 30` on a fresh database `url`: it migrates, and says
/// it moved the rollout from its default.
fn set_rollout_30(url: &str) {
    let set = pgonce()
        .args(["rollout", "--database-url", url, "30"])
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert!(set.status.success(), "{set:?}");
    assert_eq!(
        String::from_utf8_lossy(&set.stdout),
        "guard rollout: 100% -> 30%\n"
    );
}

/// `rollout` without a percent reads without migrating, so it is the one
/// command that met a database a newer build migrated without the
/// runner's check: it refuses it now, in words that say so (pgonce's
/// migrations, then the service's), and prints nothing. It printed the
/// value as this build reads it, from a schema it was not written for.
#[test]
fn rollout_read_refuses_a_database_a_newer_build_migrated() {
    let (rt, db, url) = fresh_database_url();
    set_rollout_30(&url);
    let pool = rt.block_on(db.pool(1)).unwrap();
    for version in [998_i64, 1998] {
        record_newer_migration(&rt, &pool, version);
        let out = pgonce()
            .args(["rollout", "--database-url", &url])
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{version}: {out:?}");
        assert!(
            stderr.contains(&format!(
                "a newer build migrated the database (migration {version})"
            )),
            "{stderr}"
        );
        assert!(out.stdout.is_empty(), "{out:?}");
        rt.block_on(
            sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
                .bind(version)
                .execute(&pool),
        )
        .unwrap();
    }
}

/// A URL for `db` as the role `user` with `password`.
fn as_role(db: &pgonce_testkit::ScratchDatabase, user: &str, password: &str) -> String {
    let o = db.options();
    format!(
        "postgres://{user}:{password}@{}:{}/{}",
        o.get_host(),
        o.get_port(),
        db.name()
    )
}

/// `pipeline.workers = 0`: a `worker` that still has other work (here
/// the job reaper, re-driver and cleaner, on by default) runs it and says
/// it takes no observations; one with nothing at all to run is refused,
/// naming the key, before it migrates. It idled silently, taking nothing.
#[test]
fn worker_with_no_pipeline_worker_says_so_or_is_refused() {
    let stderr = worker_refused_before_migrating(
        &[
            ("PGONCE_PIPELINE__WORKERS", "0"),
            ("PGONCE_MAINTENANCE__ENABLED", "false"),
            ("PGONCE_MAINTENANCE__CLEANER__ENABLED", "false"),
        ],
        "pipeline.workers",
    );
    assert!(stderr.contains("nothing else to run"), "{stderr}");
    let (_rt, _db, url) = fresh_database_url();
    let child = ready_worker(&url, free_port(), &[("PGONCE_PIPELINE__WORKERS", "0")]);
    let stderr = sigterm_then_exit_0(child);
    assert!(
        stderr.contains(
            "pipeline.workers = 0: this worker takes no observations; it runs \
             the job reaper and re-driver, the cleaner"
        ),
        "{stderr}"
    );
}

/// `--listen` is `serve`'s: `worker` serves no API, and refuses the flag
/// as a usage error (exit 2, naming it) before it touches the database.
/// It took the flag and ignored it, migrating and running with nothing on
/// the address the operator named.
#[test]
fn worker_refuses_listen_which_only_serve_has() {
    let (rt, db, url) = fresh_database_url();
    let out = pgonce()
        .args(["worker", "--database-url", &url, "--listen"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--listen"), "{stderr}");
    assert_never_migrated(&rt, &db);
}

/// `--help` names only the commands this build has. The product's build
/// (without the `lab` feature) has no `race`, `bench`, `demo` or `chaos`;
/// its help said they start a throwaway cluster and create a scratch
/// database on the `--database-url` server.
#[test]
fn help_names_only_the_commands_this_build_has() {
    for args in [&["--help"][..], &["serve", "--help"]] {
        let out = pgonce().args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        let help = String::from_utf8_lossy(&out.stdout);
        let words: Vec<&str> = help.split(|c: char| !c.is_alphanumeric()).collect();
        for lab in ["race", "bench", "demo", "chaos"] {
            assert_eq!(
                words.contains(&lab),
                cfg!(feature = "lab"),
                "{args:?} and {lab}:\n{help}"
            );
        }
    }
}

/// The observations queue's visibility timeout as stored.
fn stored_visibility_ms(rt: &tokio::runtime::Runtime, pool: &sqlx::PgPool) -> i64 {
    rt.block_on(
        sqlx::query_scalar("SELECT visibility_timeout_ms FROM pgonce.queue WHERE name = $1")
            .bind(pgonce_incidents::runtime::OBSERVATIONS_QUEUE)
            .fetch_one(pool),
    )
    .unwrap()
}

/// Waits until the session `backend` has ended.
fn wait_until_ended(rt: &tokio::runtime::Runtime, pool: &sqlx::PgPool, backend: i32) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let alive: bool = rt
            .block_on(
                sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)")
                    .bind(backend)
                    .fetch_one(pool),
            )
            .unwrap();
        if !alive {
            return;
        }
        assert!(Instant::now() < deadline, "the session {backend} lives on");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `pgonce worker` stopped at once while it opens its queue (migrated,
/// its update of the queue's settings waiting on the queue's row, which
/// the test holds) exits 143 in one line; the statement it had sent is
/// PostgreSQL's: it waits on, and once the row is released it runs and
/// commits, though the process is gone. With `client_connection_check_
/// interval` set for the database, PostgreSQL sees the client gone and
/// ends the session while the row is still held: nothing lands.
#[test]
fn a_statement_in_flight_at_a_stop_runs_on_unless_the_server_checks_the_client() {
    for checked in [false, true] {
        let (rt, db, url) = fresh_database_url();
        let _runtime = rt.enter();
        let pool = rt.block_on(db.pool(2)).unwrap();
        rt.block_on(pgonce_incidents::migrate(&pool)).unwrap();
        rt.block_on(pgonce_incidents::runtime::observations_queue(
            &pool,
            Duration::from_secs(30),
            5,
        ))
        .unwrap();
        if checked {
            let set = format!(
                "ALTER DATABASE {} SET client_connection_check_interval = '100ms'",
                db.name()
            );
            rt.block_on(sqlx::query(sqlx::AssertSqlSafe(set)).execute(&pool))
                .unwrap();
        }
        let (mut gate, holder) = open_gate(&rt, &pool);
        rt.block_on(
            sqlx::query("SELECT 1 FROM pgonce.queue WHERE name = $1 FOR UPDATE")
                .bind(pgonce_incidents::runtime::OBSERVATIONS_QUEUE)
                .execute(&mut *gate),
        )
        .unwrap();
        let mut child = Reaped(
            std::process::Command::new(assert_cmd::cargo::cargo_bin("pgonce"))
                .arg("worker")
                .env("DATABASE_URL", &url)
                .env("PGONCE_PIPELINE__VISIBILITY_TIMEOUT", "7s")
                .env("RUST_LOG", "warn")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let backend = blocked_backend(&rt, &pool, holder);
        let (status, stderr) = sigterm_and_wait(&mut child.0);
        assert_eq!(status.code(), Some(143), "{stderr}");
        assert_eq!(stderr.trim(), "pgonce: interrupted (SIGTERM)");
        if checked {
            // Ended by the server, the row still held.
            wait_until_ended(&rt, &pool, backend);
        }
        rt.block_on(gate.rollback()).unwrap();
        wait_until_ended(&rt, &pool, backend);
        let expected = if checked { 30_000 } else { 7_000 };
        assert_eq!(
            stored_visibility_ms(&rt, &pool),
            expected,
            "checked: {checked}"
        );
    }
}

/// `rollout` without a percent, as a role that may not read the setting,
/// fails in one line naming what it may not read (the schema,
/// `_sqlx_migrations`, where it reads which build migrated the database,
/// then the table), exit 1, nothing on stdout; granted what it reads, it
/// prints the value.
#[test]
fn rollout_read_by_a_role_without_the_right_names_what_it_may_not_read() {
    let (rt, db, url) = fresh_database_url();
    set_rollout_30(&url);
    let pool = rt.block_on(db.pool(1)).unwrap();
    let run = |sql: &str| {
        rt.block_on(sqlx::query(sqlx::AssertSqlSafe(sql.to_owned())).execute(&pool))
            .unwrap();
    };
    run("DROP ROLE IF EXISTS pgonce_rollout_reader");
    run("CREATE ROLE pgonce_rollout_reader LOGIN PASSWORD 'reader-pw'");
    let reader = as_role(&db, "pgonce_rollout_reader", "reader-pw");
    let read = || {
        pgonce()
            .args(["rollout", "--database-url", &reader])
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap()
    };
    for (grant, refused) in [
        (None, "permission denied for schema incidents"),
        (
            Some("GRANT USAGE ON SCHEMA incidents TO pgonce_rollout_reader"),
            "permission denied for table _sqlx_migrations",
        ),
        (
            Some("GRANT SELECT ON _sqlx_migrations TO pgonce_rollout_reader"),
            "permission denied for table settings",
        ),
    ] {
        if let Some(grant) = grant {
            run(grant);
        }
        let out = read();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(out.stdout.is_empty(), "{stderr}");
        let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].starts_with("pgonce: error: reading the guard rollout of ")
                && lines[0].contains(refused),
            "{stderr}"
        );
    }
    run("GRANT SELECT ON incidents.settings TO pgonce_rollout_reader");
    let out = read();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "guard rollout: 30%\n");
    run("DROP OWNED BY pgonce_rollout_reader");
    run("DROP ROLE pgonce_rollout_reader");
}

/// `serve` whose API address is taken, and `worker` whose
/// `api.metrics_listen` is, exit 1 with one line naming the address, and
/// take no message: they bind before any worker starts (a message waiting
/// on the queue stays there, never received).
#[test]
fn serve_and_worker_with_their_address_in_use_exit_1_naming_it_and_take_nothing() {
    use pgonce::Queue;
    let (rt, db, url) = fresh_database_url();
    let pool = rt.block_on(db.pool(2)).unwrap();
    rt.block_on(pgonce_incidents::migrate(&pool)).unwrap();
    let queue = rt
        .block_on(pgonce_incidents::runtime::observations_queue(
            &pool,
            Duration::from_secs(30),
            5,
        ))
        .unwrap();
    rt.block_on(queue.send(pgonce::SendMessage::new("waiting").group("in-use")))
        .unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    for (command, variable) in LISTENERS {
        exits_1_on_the_address_in_use(command, variable, &url, &taken);
        let stats = rt.block_on(queue.stats()).unwrap();
        assert_eq!(
            (stats.depth, stats.in_flight),
            (1, 0),
            "{command}: {stats:?}"
        );
    }
    let received: i32 = rt
        .block_on(
            sqlx::query_scalar("SELECT receive_count FROM pgonce.queue_message").fetch_one(&pool),
        )
        .unwrap();
    assert_eq!(received, 0);
}

/// `serve` whose API address is taken, and `worker` whose
/// `api.metrics_listen` is, on a database never migrated, exit 1 with one
/// line naming the address and leave the database as it was: they bind
/// before they migrate. (They migrated first, so a port in use was found
/// only once the schema was in, on a database the operator may not have
/// meant to migrate yet.)
#[test]
fn serve_and_worker_with_their_address_in_use_exit_1_before_migrating() {
    let (rt, db, url) = fresh_database_url();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    for (command, variable) in LISTENERS {
        exits_1_on_the_address_in_use(command, variable, &url, &taken);
        assert_never_migrated(&rt, &db);
    }
}

/// `serve` and `worker` on SQS whose queue cannot be opened (its endpoint
/// refuses connections), on a database never migrated, exit 1 with one
/// line naming the queue and leave the database as it was: they open the
/// queue before they migrate. (They migrated first, so an SQS queue
/// misnamed or out of reach was found only once the schema was in.)
#[test]
fn serve_and_worker_whose_sqs_queue_cannot_be_opened_exit_1_before_migrating() {
    let (rt, db, url) = fresh_database_url();
    let closed = free_port();
    for command in ["serve", "worker"] {
        let out = pgonce()
            .arg(command)
            .env("DATABASE_URL", &url)
            .env("PGONCE_API__LISTEN", format!("127.0.0.1:{}", free_port()))
            .env("PGONCE_QUEUE__BACKEND", "sqs")
            .env(
                "PGONCE_QUEUE__SQS__ENDPOINT_URL",
                format!("http://127.0.0.1:{closed}"),
            )
            .env("PGONCE_QUEUE__SQS__OPERATION_TIMEOUT", "2s")
            .env("PGONCE_QUEUE__SQS__REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            // The SQS backend warns of each call it could not make; the
            // exit's own line is the one looked at.
            .env("RUST_LOG", "error")
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let line = the_one_line_of_exit_1(command, &out);
        assert!(
            line.starts_with("pgonce: error: opening the SQS queue incidents-observations.fifo: "),
            "{command}: {line}"
        );
        assert_never_migrated(&rt, &db);
    }
}

/// The commands that listen, each with the variable naming its address.
const LISTENERS: [(&str, &str); 2] = [
    ("serve", "PGONCE_API__LISTEN"),
    ("worker", "PGONCE_API__METRICS_LISTEN"),
];

/// Runs `command` on the database at `url`, `variable` naming the address
/// `taken` holds, and asserts it exits 1 with one line naming it.
fn exits_1_on_the_address_in_use(
    command: &str,
    variable: &str,
    url: &str,
    taken: &std::net::TcpListener,
) {
    let address = taken.local_addr().unwrap().to_string();
    let out = pgonce()
        .arg(command)
        .env("DATABASE_URL", url)
        .env(variable, &address)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    let line = the_one_line_of_exit_1(command, &out);
    assert!(
        line.starts_with(&format!("pgonce: error: listening on {address}: ")),
        "{command}: {line}"
    );
}

/// Sends SIGTERM to `child`.
fn sigterm(child: &std::process::Child) {
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// `pgonce serve` on the database `url` (of `db`), with the variables
/// `vars`, logging at info on its piped stderr, once it is ready; with its
/// port, a pool on `db`, and an API request of it seen blocked
/// ([`held_api_request`]).
fn serve_holding_a_request(
    rt: &tokio::runtime::Runtime,
    db: &pgonce_testkit::ScratchDatabase,
    url: &str,
    vars: &[(&str, &str)],
) -> (Reaped, u16, sqlx::PgPool, HeldRequest) {
    let port = free_port();
    let mut child = Reaped(
        std::process::Command::new(assert_cmd::cargo::cargo_bin("pgonce"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .env("DATABASE_URL", url)
            .envs(vars.iter().copied())
            .env("RUST_LOG", "warn,pgonce=info")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for_200(&mut child.0, port, "/readyz");
    let pool = rt.block_on(db.pool(2)).unwrap();
    let held = held_api_request(rt, &pool, port);
    (child, port, pool, held)
}

/// An API request of a `serve` on `port`, seen blocked on a lock the test
/// holds: `GET /v1/incidents` of a new organization, with the incidents
/// table locked by `gate`.
struct HeldRequest {
    /// The transaction holding the lock; rolled back, the request goes on.
    gate: sqlx::Transaction<'static, sqlx::Postgres>,
    /// `gate`'s backend.
    holder: i32,
    /// The `serve` session the request waits in.
    blocked: i32,
    /// The organization whose key the request carries.
    organization_id: i64,
    /// The whole HTTP answer, once the request is answered.
    answer: std::thread::JoinHandle<String>,
}

fn held_api_request(rt: &tokio::runtime::Runtime, pool: &sqlx::PgPool, port: u16) -> HeldRequest {
    let (org, key) = rt
        .block_on(pgonce_incidents::store::create_organization(
            pool, "drained",
        ))
        .unwrap();
    let (mut gate, holder) = open_gate(rt, pool);
    rt.block_on(
        sqlx::query("LOCK TABLE incidents.incidents IN ACCESS EXCLUSIVE MODE").execute(&mut *gate),
    )
    .unwrap();
    let answer = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            s,
            "GET /v1/incidents?limit=5 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
             Connection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    });
    let blocked = blocked_backend(rt, pool, holder);
    HeldRequest {
        gate,
        holder,
        blocked,
        organization_id: org.id,
        answer,
    }
}

/// `serve`'s drain waits for every API request under way, however long:
/// a request seen blocked on a lock the test holds when SIGTERM comes is
/// answered 200 once the lock is released, and only then does the process
/// exit 0. `pipeline.shutdown_deadline` (1 s here) bounds the pipeline's
/// handlers, not the API's requests.
#[test]
fn serve_drains_an_api_request_under_way_until_it_is_answered() {
    let (rt, db, url) = fresh_database_url();
    let _runtime = rt.enter();
    let (mut child, port, _pool, held) = serve_holding_a_request(
        &rt,
        &db,
        &url,
        &[("PGONCE_PIPELINE__SHUTDOWN_DEADLINE", "1s")],
    );
    let HeldRequest {
        gate,
        answer: request,
        ..
    } = held;
    sigterm(&child.0);
    // Still draining: the API no longer takes connections, once it has
    // let go of its address (polled; the deadline only ends a stuck run).
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
        assert!(Instant::now() < deadline, "still taking connections");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(child.0.try_wait().unwrap().is_none(), "exited mid-request");
    rt.block_on(gate.rollback()).unwrap();
    let answer = request.join().unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let status = child.0.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{status:?}: {stderr}");
}

/// SIGTERM stops `serve`'s pipeline at once, beside the API's drain: with
/// an API request seen blocked on a lock the test holds, the workers say
/// they are shutting down, and an observation sent then is not received
/// by them (it was, while the runtime's stop waited for the API's last
/// answer). Released, the request is answered and the process exits 0;
/// the observation is still on the queue, never delivered.
#[test]
fn serve_stops_its_pipeline_at_the_signal_while_the_api_drains() {
    let (rt, db, url) = fresh_database_url();
    let _runtime = rt.enter();
    let (mut child, _port, pool, held) = serve_holding_a_request(&rt, &db, &url, &[]);
    let stderr = Stderr::of(&mut child.0);
    let mut seen = Vec::new();
    let HeldRequest {
        gate,
        holder,
        blocked,
        organization_id,
        answer: request,
    } = held;
    sigterm(&child.0);
    // Each of the two pipeline workers says so, the request still blocked.
    stderr.wait_for("worker shutting down", &mut seen);
    stderr.wait_for("worker shutting down", &mut seen);
    let still: Vec<i32> = rt
        .block_on(
            sqlx::query_scalar("SELECT unnest(pg_blocking_pids($1))")
                .bind(blocked)
                .fetch_all(&pool),
        )
        .unwrap();
    assert_eq!(still, [holder], "{}", seen.join("\n"));
    // The queue `serve` created, with its settings (the defaults).
    let queue = rt
        .block_on(pgonce_incidents::runtime::observations_queue(
            &pool,
            Duration::from_secs(30),
            5,
        ))
        .unwrap();
    let observation = pgonce_incidents::model::Observation {
        organization_id,
        entity: "late".into(),
        attributes: serde_json::json!({"cpu": 1}),
        message_id: None,
    };
    let sent = rt
        .block_on(pgonce::Queue::send(
            &queue,
            pgonce::SendMessage::new(serde_json::to_string(&observation).unwrap())
                .group(observation.group())
                .dedup("late"),
        ))
        .unwrap();
    rt.block_on(gate.rollback()).unwrap();
    let answer = request.join().unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let status = child.0.wait().unwrap();
    seen.extend(stderr.0.iter());
    assert!(status.success(), "{status:?}:\n{}", seen.join("\n"));
    let received = rt
        .block_on(pgonce::Queue::receive(
            &queue,
            pgonce::ReceiveRequest::up_to(10),
        ))
        .unwrap();
    let delivered: Vec<(String, u32)> = received
        .iter()
        .map(|m| (m.id.clone(), m.receive_count))
        .collect();
    assert_eq!(delivered, [(sent.id, 1)], "{}", seen.join("\n"));
}

/// `serve`'s drain is bounded by `shutdown.timeout`: with an API request
/// seen blocked on a lock the test holds for the whole run, SIGTERM ends
/// the process once the bound has passed (it drained for ever), exit 1,
/// its last line naming the bound and the request it abandoned.
#[test]
fn serve_whose_drain_outlasts_the_shutdown_timeout_exits_1_naming_what_it_abandoned() {
    let (rt, db, url) = fresh_database_url();
    let _runtime = rt.enter();
    let (mut child, _port, _pool, held) = serve_holding_a_request(
        &rt,
        &db,
        &url,
        &[
            ("PGONCE_PIPELINE__SHUTDOWN_DEADLINE", "1s"),
            ("PGONCE_SHUTDOWN__TIMEOUT", "7s"),
        ],
    );
    let HeldRequest {
        gate,
        answer: request,
        ..
    } = held;
    sigterm(&child.0);
    // Polled; the deadline only ends a run that never stops.
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "still draining, the request still held"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert_eq!(
        last,
        "pgonce: error: stopping took longer than shutdown.timeout (7s): stopped at once, \
         abandoning 1 API request under way",
        "{stderr}"
    );
    // The request's connection went with the process, unanswered.
    let answer = request.join().unwrap();
    assert_eq!(answer, "");
    rt.block_on(gate.rollback()).unwrap();
}
