//! The lab's commands (`race`, `bench`, `demo`) of the `pgonce` binary as a
//! user runs them: built with the `lab` feature.

use std::time::Duration;

use assert_cmd::Command;

mod common;

fn pgonce() -> Command {
    let mut cmd = Command::cargo_bin("pgonce").unwrap();
    cmd.env_remove("DATABASE_URL").env("RUST_LOG", "warn");
    cmd
}

/// Runs `pgonce ARGS` (which must include `--json`), asserts it exited 0,
/// and returns the one JSON object it printed.
fn json_report(args: &[&str]) -> serde_json::Value {
    let out = pgonce()
        .args(args)
        .timeout(Duration::from_secs(180))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn race_lock_wait_prints_one_json_object_with_an_ok_verdict() {
    let report = json_report(&["race", "lock-wait", "--json"]);
    assert_eq!(report["command"], "race");
    assert_eq!(report["name"], "lock-wait");
    assert_eq!(report["verdict"]["ok"], true);
    assert_eq!(report["environment"]["fsync"], true);
    let results = report["results"].as_array().unwrap();
    assert_eq!(results[0]["invariant_held"], true);
    assert_eq!(results[1]["invariant_held"], false);
}

#[test]
fn race_events_holds_the_invariant_under_every_strategy() {
    let report = json_report(&["race", "events", "--json"]);
    assert_eq!(report["name"], "events");
    let results = report["results"].as_array().unwrap();
    assert_eq!(
        results.len(),
        7,
        "3 strategies, 3 decision cases, 1 catch-up"
    );
    for r in results {
        assert_eq!(r["invariant_held"], true, "{r}");
    }
}

/// A `--plot` path that cannot be written is refused before the run, not
/// after it has measured for minutes: the error names the path, and the
/// database (here one nothing listens on) is never reached.
#[test]
fn bench_refuses_a_plot_path_it_cannot_write_before_running() {
    let out = pgonce()
        .args([
            "bench",
            "queue",
            "--database-url",
            "postgres://pgonce@127.0.0.1:1/nothing",
            "--plot",
            "/nonexistent-directory/queue.svg",
        ])
        .timeout(Duration::from_secs(30))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--plot: cannot write /nonexistent-directory/queue.svg"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "nothing measured, nothing printed");

    // A run that fails leaves a plot already there as it was, and leaves
    // no empty file where there was none.
    let dir = std::env::temp_dir().join(format!("pgonce-lab-kept-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (old, new) = (dir.join("old.svg"), dir.join("new.svg"));
    std::fs::write(&old, "<svg>an earlier run</svg>").unwrap();
    for path in [&old, &new] {
        let out = pgonce()
            .args(["bench", "queue", "--database-url"])
            .arg("postgres://pgonce@127.0.0.1:1/nothing")
            .arg("--plot")
            .arg(path)
            .timeout(Duration::from_secs(30))
            .output()
            .unwrap();
        assert!(!out.status.success());
    }
    assert_eq!(
        std::fs::read_to_string(&old).unwrap(),
        "<svg>an earlier run</svg>"
    );
    assert!(!new.exists(), "an empty plot was left behind");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_queue_quick_prints_both_ratios_in_one_json_object() {
    let dir = std::env::temp_dir().join(format!("pgonce-lab-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plot = dir.join("queue.svg");
    let report = json_report(&[
        "bench",
        "queue",
        "--quick",
        "--seconds",
        "0.5",
        "--json",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert_eq!(report["name"], "queue");
    for ratio in [
        "pgonce_b1_vs_raw",
        "pgonce_vs_best_peer",
        "pgonce_vs_pgmq_b1",
        "pgonce_vs_pgmq_b10",
        "pgmq_pop_b1_vs_raw",
        "raw_lease_vs_raw",
        "pgonce_b1_vs_raw_lease",
        "pgmq_b1_vs_raw_lease",
    ] {
        assert!(report["ratios"][ratio].is_number(), "{ratio}: {report}");
    }
    // --plot wrote one SVG document naming the run's strategies.
    let svg = std::fs::read_to_string(&plot).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let svg = svg.trim();
    assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"), "{svg}");
    assert_eq!(svg.matches("<svg").count(), 1);
    for text in ["Throughput per strategy", "pgmq-b10", "pgonce_vs_pgmq_b1"] {
        assert!(svg.contains(text), "no {text:?} in the plot");
    }
    let strategies: Vec<_> = report["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["strategy"].as_str().unwrap().to_string())
        .collect();
    for s in ["raw-insert-delete", "raw-insert-lease-delete"] {
        assert!(strategies.iter().any(|x| x == s), "{s} missing");
    }
    assert!(strategies.iter().any(|s| s.starts_with("apalis-postgres")));
    for s in ["pgmq-b1", "pgmq-b10", "pgmq-pop-b1"] {
        assert!(
            strategies.iter().any(|x| x == s),
            "{s} missing: {strategies:?}"
        );
    }
    // The server's WAL per message, where the scenario consumed messages
    // in the window it is read over.
    let wal: Vec<f64> = report["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r.get("wal_bytes_per_msg"))
        .map(|v| v.as_f64().expect("a number"))
        .collect();
    assert!(!wal.is_empty(), "no WAL per message in {report}");
    assert!(wal.iter().all(|&b| b > 0.0), "{wal:?}");
}

#[test]
fn race_jobs_exits_0_with_exactly_one_side_effect_under_two_phase() {
    let report = json_report(&["race", "jobs", "--json"]);
    let row = |name: &str| {
        report["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["strategy"] == name)
            .unwrap_or_else(|| panic!("no row {name}"))
            .clone()
    };
    assert_eq!(row("two-phase")["side_effects"], 1);
    assert_eq!(row("two-phase")["transitions_applied"], 1);
    assert_eq!(row("where-status")["side_effects"], 2);
    assert_eq!(row("late-completion")["second_delivery"], "LeaseLost");
    assert_eq!(row("crash")["final_status"], "completed");
}

#[test]
fn bench_events_quick_measures_the_peer_and_prints_both_goal_ratios() {
    let report = json_report(&["bench", "events", "--quick", "--seconds", "0.3", "--json"]);
    assert_eq!(report["name"], "events");
    for ratio in [
        "advisory_vs_table_lock_disjoint_16w",
        "pgonce_vs_disintegrate_disjoint_16w",
        "advisory_locks_of_unconditioned_disjoint_16w",
        "table_lock_of_unconditioned_one_tag_16w",
        "serializable_of_unconditioned_4_per_tag_16w",
    ] {
        assert!(report["ratios"][ratio].is_number(), "{ratio}: {report}");
    }
    let strategies: Vec<_> = report["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["strategy"].as_str().unwrap().to_string())
        .collect();
    for s in [
        "serializable",
        "table-lock",
        "advisory-locks",
        "disintegrate-postgres",
        "unconditioned-insert",
    ] {
        assert!(
            strategies.iter().any(|x| x == s),
            "{s} missing: {strategies:?}"
        );
    }
    // Both goals stated, each beside what the run measured.
    let goal = |figure: &str| {
        report["goals"]
            .as_array()
            .expect("goals")
            .iter()
            .find(|g| g["figure"] == figure)
            .unwrap_or_else(|| panic!("no goal for {figure}: {report}"))
            .clone()
    };
    for (figure, target) in [
        ("pgonce_vs_disintegrate_disjoint_16w", 1.2),
        ("advisory_locks_of_unconditioned_disjoint_16w", 0.7),
    ] {
        let g = goal(figure);
        assert_eq!(g["bound"], "at_least", "{g}");
        assert_eq!(g["target"], target, "{g}");
        assert_eq!(g["measured"], report["ratios"][figure], "{g}");
        assert!(g["met"].is_boolean(), "{g}");
    }
}

#[test]
fn race_sequence_keeps_i2_under_the_default_and_tells_the_truth_about_the_others() {
    let report = json_report(&["race", "sequence", "--json"]);
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
    for row in report["results"].as_array().unwrap() {
        assert_eq!(row["told_vs_committed"], "agree", "{row}");
    }
}

#[test]
fn bench_sequence_quick_prints_both_figures_in_one_json_object() {
    let report = json_report(&["bench", "sequence", "--quick", "--json"]);
    assert_eq!(report["verdict"]["ok"], true, "{report:#}");
    assert!(report["ratios"]["advisory_vs_table_lock_s8_early"].is_number());
    let slo = report["sections"]["one scope, 50 declarers, against the 3 s declaration SLO"]
        .as_array()
        .unwrap();
    assert!(slo.iter().all(|r| r["p99_ms"].is_number()
        && r["lock_hold_p99_ms"].is_number()
        && r["slo_ms"] == 3000.0));
    for row in report["results"].as_array().unwrap() {
        assert_eq!(row["violations"], 0, "{row}");
    }
}

#[test]
fn demo_small_holds_every_invariant_and_rollout_0_shows_i1_broken() {
    let small = [
        "demo",
        "--organizations",
        "1",
        "--entities",
        "6",
        "--observations",
        "150",
        "--visibility-ms",
        "300",
        "--json",
    ];
    let report = json_report(&small);
    assert_eq!(report["command"], "demo");
    let invariants = report["sections"]["invariants"].as_array().unwrap();
    assert_eq!(invariants.len(), 4);
    for row in invariants {
        assert_eq!(row["held"], true, "{row}");
    }

    // Without the guard the same run breaks I1 and exits 1, but still
    // prints its report.
    let mut args = small.to_vec();
    args.extend(["--rollout", "0", "--no-people", "--slow-rate", "0.3"]);
    let out = pgonce().args(&args).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let i1 = &report["sections"]["invariants"][0];
    assert_eq!(i1["strategy"], "I1");
    assert_eq!(i1["held"], false, "{i1}");
}

#[test]
fn bench_service_quick_prints_the_p99_in_one_json_object() {
    let report = json_report(&["bench", "service", "--quick", "--seconds", "0.5", "--json"]);
    assert_eq!(report["verdict"]["ok"], true, "{report}");
    let results = report["results"].as_array().unwrap();
    assert!(
        results
            .iter()
            .any(|r| r["strategy"] == "advisory-lock" && r["p99_ms"].as_f64().is_some())
    );
    for ratio in [
        "table_lock_p99_vs_advisory_p99",
        "counter_row_p99_vs_advisory_p99",
        "advisory_vs_table_lock_declarations",
    ] {
        assert!(report["ratios"][ratio].as_f64().is_some(), "{ratio}");
    }
    let goal = &report["goals"][0];
    assert_eq!(goal["figure"], "declaration_p99_ms", "{goal}");
    assert!(goal["measured"].as_f64().is_some(), "{goal}");
    assert_eq!(goal["bound"], "at_most", "{goal}");
    assert_eq!(goal["target"], 150.0, "{goal}");
    assert_eq!(goal["unit"], "ms", "{goal}");
}

#[test]
fn race_events_late_writer_holds_every_condition_under_every_strategy() {
    let report = json_report(&["race", "events-late-writer", "--json"]);
    assert_eq!(report["name"], "events-late-writer");
    assert_eq!(report["verdict"]["ok"], true, "{report:#}");
}

/// Numbers a lab command turns into durations are refused when no duration
/// holds them, never a panic: `bench --seconds` by its argument parser
/// (exit 2, naming the flag), the demo in its JSON report, a run that
/// could not finish (exit 3).
#[test]
fn durations_no_clock_holds_are_refused_without_a_panic() {
    for seconds in ["inf", "NaN", "1e300", "0", "-1"] {
        let out = pgonce()
            .args(["bench", "lock", "--quick", &format!("--seconds={seconds}")])
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{seconds}: {stderr}");
        assert!(stderr.contains("--seconds"), "{seconds}: {stderr}");
        assert!(!stderr.contains("panicked"), "{seconds}: {stderr}");
    }
    for flags in [
        ["--deadline-secs", "18446744073709551615"],
        ["--deadline-secs", "0"],
        ["--restart-at", "1e300"],
    ] {
        let out = pgonce()
            .args(["demo", "--json"])
            .args(flags)
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{flags:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["verdict"]["ok"], false, "{flags:?}: {report}");
        assert_eq!(report["verdict"]["violated"], false, "{flags:?}: {report}");
    }
}

/// SIGTERM (what `kill`, a service manager or a container runtime sends)
/// stops a lab command as Ctrl-C does: exit 143, one line, and the scratch
/// database it made on the server it was given is dropped. (SIGTERM used
/// to kill it outright and leave the database behind, with any child
/// process still running.)
#[test]
fn sigterm_stops_a_lab_command_and_drops_its_scratch_database() {
    let (rt, db, url) = common::fresh_database_url();
    let pool = rt.block_on(db.pool(1)).unwrap();
    let scratch = || -> Vec<String> {
        rt.block_on(
            sqlx::query_scalar(
                "SELECT datname::text FROM pg_database WHERE datname LIKE 'pgonce_bench%' ORDER BY 1",
            )
            .fetch_all(&pool),
        )
        .unwrap()
    };
    let before = scratch();
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("pgonce"))
        .args(["bench", "lock", "--quick", "--seconds", "60"])
        .args(["--database-url", &url])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Waits for the command to have made its scratch database.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while scratch().len() == before.len() {
        assert!(std::time::Instant::now() < deadline, "no scratch database");
        assert!(child.try_wait().unwrap().is_none(), "the bench ended early");
        std::thread::sleep(Duration::from_millis(100));
    }
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(143), "{stderr}");
    assert!(stderr.contains("SIGTERM"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(scratch(), before, "the scratch database is left: {stderr}");
}

/// A plot that passes the check before the run but cannot be written after
/// it (a full disk: /dev/full takes the open, refuses the data) costs the
/// plot, not the run: the report is printed, its verdict saying the plot
/// is missing, and the command exits 3, a run that could not finish (a
/// missing plot is no violation).
#[test]
fn a_plot_that_fails_to_write_after_the_run_keeps_the_report() {
    let out = pgonce()
        .args(["bench", "lock", "--quick", "--seconds", "0.2", "--json"])
        .args(["--plot", "/dev/full"])
        .timeout(Duration::from_secs(180))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verdict"]["ok"], false);
    assert_eq!(report["verdict"]["violated"], false);
    assert!(
        report["verdict"]["reasons"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r.as_str().unwrap().contains("the plot was not written"))
    );
    assert!(!report["results"].as_array().unwrap().is_empty());
}

/// A lab command cut short by a fatal error (here: its server out of
/// reach) could not finish, which is no violation: exit 3, as a report
/// whose run could not finish. It exited 1, the code of a broken
/// invariant.
#[test]
fn a_lab_command_cut_short_by_an_error_exits_3_not_1() {
    for command in [["bench", "lock"], ["race", "lock-wait"]] {
        let out = pgonce()
            .args(command)
            .args(["--database-url", "postgres://postgres@127.0.0.1:1/absent"])
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{command:?}: {stderr}");
        assert!(stderr.contains("127.0.0.1:1"), "{command:?}: {stderr}");
    }
}

/// `--json` shapes the lab's reports; the product's commands (`migrate`,
/// `rollout`, `serve`, `worker`) refuse it as a usage error (exit 2,
/// naming it) before they touch the database. They took it and ignored
/// it: `rollout --json` migrated, then printed text to a caller that asked
/// for JSON.
#[test]
fn the_products_commands_refuse_json() {
    let (rt, db, url) = common::fresh_database_url();
    for command in ["migrate", "rollout", "serve", "worker"] {
        let out = pgonce()
            .args([command, "--json", "--database-url", &url])
            .timeout(Duration::from_secs(60))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{command}: {stderr}");
        assert!(stderr.contains("--json"), "{command}: {stderr}");
        assert!(out.stdout.is_empty(), "{command}: {stderr}");
    }
    common::assert_never_migrated(&rt, &db);
}
