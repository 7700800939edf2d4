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

/// The product's commands through PgBouncer in transaction mode, set up as
/// the README says, with no direct URL: `migrate` applies the library's
/// schema, `rollout 30` the service's and sets the value, and `rollout`
/// reads it back in its read-only transaction, each transaction on
/// whatever server connection the pooler gives it (the migrations take
/// their lock per transaction, no statement sets session state).
#[test]
fn migrate_and_rollout_run_through_a_transaction_pooler() {
    let server = shared_for_tests().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt.block_on(pgonce_testkit::fresh_database());
    let pooler = Pooler::start(server.options()).unwrap();
    let url = format!(
        "postgres://{}@127.0.0.1:{}/{}",
        server.options().get_username(),
        pooler.port(),
        db.name()
    );
    let run = |args: &[&str]| {
        let out = Command::cargo_bin("pgonce")
            .unwrap()
            .env_remove("DATABASE_URL")
            .env("RUST_LOG", "warn")
            .args(args)
            .args(["--database-url", &url])
            .timeout(Duration::from_secs(120))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{args:?}: {stderr}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run(&["migrate"]);
    assert_eq!(run(&["rollout", "30"]), "guard rollout: 100% -> 30%\n");
    assert_eq!(run(&["rollout"]), "guard rollout: 30%\n");
}
