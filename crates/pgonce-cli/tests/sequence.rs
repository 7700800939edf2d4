//! `pgonce race seed004` and `pgonce bench sequence` as a user runs them.

use std::time::Duration;

use assert_cmd::Command;

fn pgonce() -> Command {
    let mut cmd = Command::cargo_bin("pgonce").unwrap();
    cmd.env_remove("DATABASE_URL").env("RUST_LOG", "error");
    cmd
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = pgonce()
        .args(args)
        .timeout(Duration::from_secs(180))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn race_seed004_keeps_i2_under_the_default_and_tells_the_truth_about_the_others() {
    let report = json(&["race", "seed004", "--json"]);
    assert_eq!(report["verdict"]["ok"], true, "{report:#}");
    let by_strategy = |name: &str| {
        report["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["strategy"] == name)
            .unwrap_or_else(|| panic!("no row for {name}"))
            .clone()
    };
    let advisory = by_strategy("advisory-lock");
    assert_eq!(advisory["invariant_held"], true);
    assert_eq!(advisory["other_scope"], "C: no wait");
    assert_eq!(advisory["rollback_number_reused"], true);
    assert_eq!(by_strategy("table-lock")["invariant_held"], false);
    assert_eq!(by_strategy("select-for-update")["failed_declarations"], 1);
}

#[test]
fn bench_sequence_quick_prints_both_figures_in_one_json_object() {
    let report = json(&["bench", "sequence", "--quick", "--json"]);
    assert_eq!(report["verdict"]["ok"], true, "{report:#}");
    assert!(report["ratios"]["advisory_vs_table_lock_s8_early"].is_number());
    let slo = report["sections"]["one scope, 50 declarers, against the seed's 3 s SLO"]
        .as_array()
        .unwrap();
    assert!(slo.iter().all(|r| r["p99_ms"].is_number()
        && r["lock_hold_p99_ms"].is_number()
        && r["slo_ms"] == 3000.0));
    for row in report["results"].as_array().unwrap() {
        assert_eq!(row["violations"], 0, "{row}");
    }
}
