//! The API under Schemathesis: a real instance served by [`api::serve`] on
//! a throwaway database, fuzzed from its own `/openapi.json` with every
//! check (server errors, status codes, content types, response schemas,
//! positive data accepted, negative data refused, auth ignored, unsupported
//! methods...), a fixed seed and a few examples per operation. Zero
//! failures. A Schemathesis hook (`tests/fuzz/hooks.py`) gives generated
//! observations the fuzzed organization's id, so that their entity,
//! attributes and message id are fuzzed too (another organization's id is
//! refused before those are looked at).
//!
//! Schemathesis is a test dependency the project installs itself
//! (`scripts/ensure-schemathesis.sh`, sourced by `scripts/test`, exports
//! `SCHEMATHESIS`). Without it the test is skipped with a message, except
//! under CI (`CI` set), where it fails. `API_FUZZ_EXAMPLES` sets the
//! examples per operation (default 5) and `API_FUZZ_SEED` the seed, for
//! a deeper run (README, "Fuzzing the API").

use std::path::{Path, PathBuf};
use std::time::Duration;

use pgonce_incidents::api::{self, ApiConfig, ApiState};
use pgonce_incidents::runtime::observations_queue;
use pgonce_incidents::{Service, ServiceConfig, store};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

const ADMIN: &str = "fuzz-admin-token-0123456789";

/// The Schemathesis CLI: `$SCHEMATHESIS`, else the one the install script
/// puts in the workspace's `.tools`.
fn schemathesis() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("SCHEMATHESIS").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let tools = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.tools");
    std::fs::read_dir(tools)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin/st"))
        .find(|st| st.is_file())
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_nothing() {
    let Some(st) = schemathesis() else {
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false");
        assert!(
            !ci,
            "schemathesis is missing under CI: scripts/ensure-schemathesis.sh installs it"
        );
        eprintln!(
            "SKIPPED schemathesis_finds_nothing: schemathesis is not installed \
             (source scripts/ensure-schemathesis.sh, or set SCHEMATHESIS)"
        );
        return;
    };

    let (_db, pool) = pgonce_testkit::fresh_migrated_database(8, pgonce_incidents::migrate).await;
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let (organization, key) = store::create_organization(&pool, "fuzzed").await.unwrap();
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let config = ApiConfig {
        admin_token: Some(ADMIN.into()),
        // Long polls would only slow the run down.
        max_wait: Duration::from_millis(100),
        ..ApiConfig::default()
    };
    let state = ApiState::new(service, queue, None, config.clone()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        api::serve(listener, api::router(state), &config, async {
            let _ = stopped.await;
        })
        .await
    });

    let settings = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/schemathesis.toml");
    // Observations of the fuzzed organization (see the file).
    let hooks = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/hooks.py");
    let report = tempfile_dir();
    let output = tokio::process::Command::new(&st)
        .arg("--config-file")
        .arg(&settings)
        .arg("run")
        .arg(format!("http://{address}/openapi.json"))
        .args(["--checks", "all"])
        .args(["--seed", &env_or("API_FUZZ_SEED", "20261125")])
        .args(["--max-examples", &env_or("API_FUZZ_EXAMPLES", "5")])
        // One worker: Python 3.11's parser is not safe to use from several
        // threads at once, which Schemathesis's workers do.
        .args(["--workers", "1"])
        .args(["--generation-database", "none"])
        .args(["--request-timeout", "10"])
        .arg("--no-color")
        .arg("--report-dir")
        .arg(&report)
        // Schemathesis keeps a cache in its working directory: not the
        // repository's.
        .current_dir(&report)
        .env("API_FUZZ_API_KEY", &key)
        .env("API_FUZZ_ADMIN_TOKEN", ADMIN)
        .env("API_FUZZ_ORGANIZATION_ID", organization.id.to_string())
        .env("SCHEMATHESIS_HOOKS", &hooks)
        .kill_on_drop(true)
        .output()
        .await
        .expect("schemathesis runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}\n{stderr}");
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    assert!(
        output.status.success(),
        "schemathesis found failures ({}):\n{stdout}\n{stderr}",
        output.status
    );
}

/// A fresh directory for Schemathesis's reports and cache, in the system's
/// temporary space.
fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pgonce-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
