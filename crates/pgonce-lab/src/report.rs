//! The one output format of `race`, `bench` and `demo`: a readable table, or
//! with `--json` exactly one JSON object on stdout:
//!
//! ```text
//! {"command", "name", "environment", "results": [{"strategy", ...figures}],
//!  "ratios": {"<a>_vs_<b>": x}, "goals": [{"figure", "bound", "target",
//!  "unit", "measured", "met", "note"}], "sections": {...},
//!  "verdict": {"ok", "reasons"}}
//! ```
//!
//! `goals` are the performance goals a suite states, each beside what the
//! run measured: printed, drawn by `--plot`, never part of the verdict.
//!
//! Figures use the shared names where they apply: `ops_per_sec`, `p50_ms`,
//! `p99_ms`, `max_ms`, `conflicts`, `aborts`, `retries`, `violations`,
//! `invariant_held`. The process exits 0 iff `verdict.ok`.

use std::collections::BTreeMap;

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;
use serde_json::{Map, Value};
use sqlx::PgPool;

/// Where a report was measured.
#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    pub(crate) postgres_version: String,
    pub(crate) cpus: usize,
    pub(crate) fsync: bool,
    pub(crate) synchronous_commit: String,
    /// `throwaway` (a cluster started for this run) or `external`.
    pub(crate) server: &'static str,
    pub(crate) pgonce_version: &'static str,
    /// The machine's 1-minute load average when the report's environment
    /// was read, before the run's own load: how quiet the machine was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) load_at_start: Option<f64>,
}

/// The machine's 1-minute load average (`/proc/loadavg`), where there is one.
pub(crate) fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

impl Environment {
    /// Reads the server's settings through `pool`.
    pub(crate) async fn read(pool: &PgPool, throwaway: bool) -> anyhow::Result<Environment> {
        /// The server settings a report names.
        #[derive(sqlx::FromRow)]
        struct Settings {
            version: String,
            fsync: String,
            synchronous_commit: String,
        }
        let Settings {
            version,
            fsync,
            synchronous_commit: sync_commit,
        } = sqlx::query_as(
            "SELECT current_setting('server_version') AS version, \
             current_setting('fsync') AS fsync, \
             current_setting('synchronous_commit') AS synchronous_commit",
        )
        .fetch_one(pool)
        .await?;
        Ok(Environment {
            postgres_version: version,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            fsync: fsync == "on",
            synchronous_commit: sync_commit,
            server: if throwaway { "throwaway" } else { "external" },
            pgonce_version: env!("CARGO_PKG_VERSION"),
            load_at_start: load_average(),
        })
    }
}

impl Environment {
    /// For a run that failed before the server could be asked.
    pub fn unknown() -> Environment {
        Environment {
            postgres_version: "unknown".into(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            fsync: false,
            synchronous_commit: "unknown".into(),
            server: "unknown",
            pgonce_version: env!("CARGO_PKG_VERSION"),
            load_at_start: load_average(),
        }
    }
}

/// Whether the run showed what it set out to show, and why not.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Verdict {
    /// Whether every check passed; the command exits 0 only then.
    pub ok: bool,
    /// What each failed check said, in the order they failed.
    pub reasons: Vec<String>,
}

impl Verdict {
    /// Starts as ok; each failed [`Verdict::check`] turns it false.
    pub(crate) fn new() -> Verdict {
        Verdict {
            ok: true,
            reasons: Vec::new(),
        }
    }

    /// Records `reason`, prefixed `ok:` or `FAILED:`, and clears `ok` when
    /// `holds` is false.
    pub(crate) fn check(&mut self, holds: bool, reason: impl Into<String>) {
        let reason = reason.into();
        self.ok &= holds;
        self.reasons
            .push(format!("{}: {reason}", if holds { "ok" } else { "FAILED" }));
    }
}

/// Which side of its target a goal's figure has to be on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Bound {
    AtLeast,
    AtMost,
}

/// A performance goal a suite states for one of its figures, with what the
/// run measured. Goals are reported, never enforced: the verdict is about
/// correctness, and a 2-core machine shared with other work cannot promise
/// a figure. The suite that measures a figure states its goal, so the
/// table, the JSON and the plot all read it from the report.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Goal {
    /// A ratio's name (the plot marks the goal on that ratio's bar), or a
    /// figure of the results named in words.
    pub(crate) figure: String,
    pub(crate) bound: Bound,
    pub(crate) target: f64,
    /// The unit of `target` and `measured`: `x` for a ratio.
    pub(crate) unit: &'static str,
    /// `None` when this run could not measure the figure (`note` says why).
    pub(crate) measured: Option<f64>,
    /// `None` when not measured.
    pub(crate) met: Option<bool>,
    /// What the figure is measured under, or why it was not measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) note: Option<String>,
}

impl Goal {
    /// A ratio that should be at least `target`.
    pub(crate) fn ratio_at_least(ratio: &str, target: f64) -> Goal {
        Goal::new(ratio, Bound::AtLeast, target, "x")
    }

    /// A figure in milliseconds that should be at most `target`.
    pub(crate) fn ms_at_most(figure: &str, target: f64) -> Goal {
        Goal::new(figure, Bound::AtMost, target, "ms")
    }

    fn new(figure: &str, bound: Bound, target: f64, unit: &'static str) -> Goal {
        Goal {
            figure: figure.into(),
            bound,
            target,
            unit,
            measured: None,
            met: None,
            note: None,
        }
    }

    /// What the run measured; whether the goal is met follows from it.
    pub(crate) fn measured(mut self, value: Option<f64>) -> Goal {
        self.measured = value;
        self.met = value.map(|v| match self.bound {
            Bound::AtLeast => v >= self.target,
            Bound::AtMost => v <= self.target,
        });
        self
    }

    pub(crate) fn note(mut self, note: impl Into<String>) -> Goal {
        self.note = Some(note.into());
        self
    }

    /// The goal as a person reads it: `>= 1.2x`, `<= 150 ms`.
    pub(crate) fn target_text(&self) -> String {
        let sign = match self.bound {
            Bound::AtLeast => ">=",
            Bound::AtMost => "<=",
        };
        match self.unit {
            "x" => format!("{sign} {}x", self.target),
            unit => format!("{sign} {} {unit}", self.target),
        }
    }
}

/// One row of results: `strategy` first, then figures in insertion order.
#[derive(Debug, Clone, Default)]
pub struct Row(Map<String, Value>);

impl Row {
    pub(crate) fn new(strategy: impl Into<String>) -> Row {
        let mut map = Map::new();
        map.insert("strategy".into(), Value::String(strategy.into()));
        Row(map)
    }

    /// Adds a figure; anything `serde_json` can represent.
    pub(crate) fn with(mut self, name: &str, value: impl Serialize) -> Row {
        self.set(name, value);
        self
    }

    /// A field as a number, if it is one.
    pub(crate) fn number(&self, name: &str) -> Option<f64> {
        self.0.get(name).and_then(Value::as_f64)
    }

    /// A field as text: strings as they are, other values as JSON.
    pub fn text(&self, name: &str) -> Option<String> {
        match self.0.get(name)? {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            v => Some(v.to_string()),
        }
    }

    /// The names of the row's fields, in insertion order.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    pub(crate) fn set(&mut self, name: &str, value: impl Serialize) {
        self.0.insert(
            name.to_string(),
            serde_json::to_value(value).unwrap_or(Value::Null),
        );
    }
}

/// A complete report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub(crate) command: &'static str,
    pub(crate) name: String,
    pub(crate) environment: Environment,
    /// The main table: one row per strategy, case or measurement.
    #[serde(serialize_with = "rows")]
    pub results: Vec<Row>,
    pub(crate) ratios: BTreeMap<String, f64>,
    /// The performance goals the suite states, beside what this run
    /// measured (`Report::goal`, `Report::ratio_goal`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) goals: Vec<Goal>,
    /// Further named tables (a timeline, a comparison table), shown after
    /// the results.
    #[serde(
        skip_serializing_if = "BTreeMap::is_empty",
        serialize_with = "sections"
    )]
    pub sections: BTreeMap<String, Vec<Row>>,
    /// Whether the run showed what it set out to show; sets the exit code.
    pub verdict: Verdict,
}

fn rows<S: serde::Serializer>(rows: &[Row], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(rows.iter().map(|r| &r.0))
}

fn sections<S: serde::Serializer>(
    sections: &BTreeMap<String, Vec<Row>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(
        sections
            .iter()
            .map(|(k, v)| (k, v.iter().map(|r| &r.0).collect::<Vec<_>>())),
    )
}

impl Report {
    pub(crate) fn new(command: &'static str, name: &str, environment: Environment) -> Report {
        Report {
            command,
            name: name.to_string(),
            environment,
            results: Vec::new(),
            ratios: BTreeMap::new(),
            goals: Vec::new(),
            sections: BTreeMap::new(),
            verdict: Verdict::new(),
        }
    }

    /// Adds `a_vs_b` = `a / b`, rounded to two decimals; skipped when `b` is 0.
    pub(crate) fn ratio(&mut self, name: &str, a: f64, b: f64) -> Option<f64> {
        if b == 0.0 || !a.is_finite() || !b.is_finite() {
            return None;
        }
        let r = (a / b * 100.0).round() / 100.0;
        self.ratios.insert(name.to_string(), r);
        Some(r)
    }

    /// States a goal for a figure of this run (its measured value set).
    pub(crate) fn goal(&mut self, goal: Goal) {
        self.goals.push(goal);
    }

    /// States that the ratio `name` should be at least `target`, measured
    /// as this run's ratio of that name (not measured when it has none);
    /// returns the goal, to add a note.
    pub(crate) fn ratio_goal(&mut self, name: &str, target: f64) -> &mut Goal {
        self.goal(Goal::ratio_at_least(name, target).measured(self.ratios.get(name).copied()));
        self.goals.last_mut().expect("a goal was just stated")
    }

    /// Prints the report: JSON on stdout, or tables.
    pub fn print(&self, json: bool) {
        if json {
            println!(
                "{}",
                serde_json::to_string(self).expect("a report always serialises")
            );
            return;
        }
        let env = &self.environment;
        println!("pgonce {} {}", self.command, self.name);
        println!(
            "PostgreSQL {} ({} server), {} CPUs, fsync {}, synchronous_commit {}{}",
            env.postgres_version,
            env.server,
            env.cpus,
            if env.fsync { "on" } else { "OFF" },
            env.synchronous_commit,
            env.load_at_start
                .map(|l| format!(", load average {l:.2} when it began"))
                .unwrap_or_default()
        );
        println!();
        println!("{}", table(&self.results));
        if !self.ratios.is_empty() {
            println!();
            let mut t = Table::new();
            t.load_style(UTF8_FULL_CONDENSED)
                .set_header(["ratio", "value"]);
            for (k, v) in &self.ratios {
                t.add_row([k.clone(), format!("{v:.2}")]);
            }
            println!("{t}");
        }
        if !self.goals.is_empty() {
            println!();
            println!("goals (informational, the verdict is about correctness)");
            let mut t = Table::new();
            t.load_style(UTF8_FULL_CONDENSED)
                .set_header(["figure", "goal", "measured", "met", "note"]);
            for g in &self.goals {
                t.add_row([
                    g.figure.clone(),
                    g.target_text(),
                    g.measured
                        .map(|m| format!("{m:.2}"))
                        .unwrap_or_else(|| "-".into()),
                    match g.met {
                        Some(true) => "yes",
                        Some(false) => "NO",
                        None => "not measured",
                    }
                    .into(),
                    g.note.clone().unwrap_or_default(),
                ]);
            }
            println!("{t}");
        }
        for (title, rows) in &self.sections {
            println!();
            println!("{title}");
            println!("{}", table(rows));
        }
        println!();
        println!("verdict: {}", if self.verdict.ok { "ok" } else { "FAILED" });
        for reason in &self.verdict.reasons {
            println!("  - {reason}");
        }
    }
}

/// Renders rows as a table whose columns are every key, in first-seen order.
fn table(rows: &[Row]) -> Table {
    let mut columns: Vec<&str> = Vec::new();
    for row in rows {
        for key in row.0.keys() {
            if !columns.contains(&key.as_str()) {
                columns.push(key);
            }
        }
    }
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED).set_header(&columns);
    for row in rows {
        t.add_row(columns.iter().map(|c| cell(row.0.get(*c))));
    }
    t
}

fn cell(value: Option<&Value>) -> String {
    match value {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => if *b { "yes" } else { "no" }.into(),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(f) if n.is_f64() => format!("{f:.2}"),
            _ => n.to_string(),
        },
        Some(other) => other.to_string(),
    }
}
