//! The `pgonce` binary behind a PgBouncer set up wrongly: the error names
//! the cause and the fix, on one line, once.

use std::time::Duration;

use assert_cmd::Command;
use pgonce_testkit::{Pooler, PoolerSetup, shared_for_tests};

#[test]
fn migrate_through_a_pooler_refusing_startup_parameters_names_the_fix_once() {
    let server = shared_for_tests().unwrap();
    let pooler =
        Pooler::start_with(server.options(), PoolerSetup::StrictStartupParameters).unwrap();
    let url = format!(
        "postgres://{}@127.0.0.1:{}/postgres",
        server.options().get_username(),
        pooler.port()
    );
    let out = Command::cargo_bin("pgonce")
        .unwrap()
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .arg("migrate")
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    let line = lines[0];
    assert!(line.contains("connection pooler"), "{line}");
    for once in ["unsupported startup parameter", "ignore_startup_parameters"] {
        assert_eq!(line.matches(once).count(), 1, "{once:?} once: {line}");
    }
}
