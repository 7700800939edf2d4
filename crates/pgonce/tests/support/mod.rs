//! Pieces several test files share. Each test file is its own crate and
//! uses only some of them, hence the crate-wide `dead_code` allowance.
#![allow(dead_code)]

pub mod mixed;

use proptest::test_runner::{Config, FileFailurePersistence};

/// The environment variable that sets every model's number of cases.
pub const CASES_VAR: &str = "PGONCE_PROPTEST_CASES";

/// A proptest configuration for a model checked against PostgreSQL:
/// `default_cases` cases unless `PGONCE_PROPTEST_CASES` says otherwise, and
/// a failing case's seed persisted beside the test file
/// (`tests/<file>.proptest-regressions`, committed), so the next run
/// replays it first.
///
/// `WithSource` rather than proptest's default `SourceParallel`: the
/// default looks for a `lib.rs` above the test file, finds none under
/// `tests/`, warns, and falls back to this same path.
pub fn model_config(default_cases: u32) -> Config {
    let cases = std::env::var(CASES_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    }
}
