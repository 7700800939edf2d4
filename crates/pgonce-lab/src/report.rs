//! The one output format of `race`, `bench` and `demo`: a readable table, or
//! with `--json` exactly one JSON object on stdout:
//!
//! ```text
//! {"command", "name", "environment", "results": [{"strategy", ...figures}],
//!  "ratios": {"<a>_vs_<b>": x}, "goals": [{"figure", "bound", "target",
//!  "unit", "measured", "met", "note"}], "sections": {...},
//!  "verdict": {"ok", "finished", "violated", "reasons"}}
//! ```
//!
//! `goals` are the performance goals a suite states, each beside what the
//! run measured: printed, drawn by `--plot`, never part of the verdict.
//!
//! Figures use the shared names where they apply: `ops_per_sec`, `p50_ms`,
//! `p99_ms`, `max_ms`, `conflicts`, `aborts`, `retries`, `violations`,
//! `invariant_held`.
//!
//! The verdict is about correctness, never timing. It has three outcomes
//! ([`Outcome`]), each with its exit code: ok (`verdict: ok`, exit 0); a
//! violation (`verdict: FAILED`, `violated`, exit 1); a run that could not
//! finish, its work still pending when a wait stalled or a fatal error cut
//! it short (`verdict: COULD NOT FINISH`, `finished` false, exit 3). A
//! violation wins; `ok` is `finished && !violated`.

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

/// Whether the run showed what it set out to show, and why not. One of
/// three outcomes ([`Verdict::outcome`]): ok; a violation (an invariant
/// broken, an error where none may be); or a run that could not finish
/// (work still pending when a wait stalled past its window, a fatal error,
/// an output that could not be written), which is neither ok nor a
/// violation: a busy machine can cause it, a broken invariant cannot hide
/// behind it. A violation wins over an unfinished run.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// `finished && !violated`; the command exits 0 only then.
    pub ok: bool,
    /// Every wait of the run ended with its work done, and no fatal error
    /// cut it short.
    pub finished: bool,
    /// A check of correctness failed.
    pub violated: bool,
    /// What each check said, in the order they were made: `ok: ...`,
    /// `FAILED: ...` (a violation) or `UNFINISHED: ...`.
    pub reasons: Vec<String>,
}

/// The outcome of a run, from its [`Verdict`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every check held and the run finished.
    Ok,
    /// A check of correctness failed (whether or not the run finished).
    Violated,
    /// No check failed, but the run could not finish.
    Unfinished,
}

/// The exit code of a lab command whose run could not finish: a stall, a
/// fatal error. 0 is ok, 1 a violation.
pub const EXIT_UNFINISHED: u8 = 3;

impl Outcome {
    /// The process's exit code: 0 ok, 1 a violation, [`EXIT_UNFINISHED`]
    /// (3) a run that could not finish.
    pub fn exit_code(self) -> u8 {
        match self {
            Outcome::Ok => 0,
            Outcome::Violated => 1,
            Outcome::Unfinished => EXIT_UNFINISHED,
        }
    }

    /// As the report's table prints it after `verdict: `.
    pub fn text(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Violated => "FAILED",
            Outcome::Unfinished => "COULD NOT FINISH",
        }
    }
}

impl Verdict {
    /// Starts as ok: finished, nothing violated.
    pub(crate) fn new() -> Verdict {
        Verdict {
            ok: true,
            finished: true,
            violated: false,
            reasons: Vec::new(),
        }
    }

    /// A check of correctness: records `reason`, prefixed `ok:` or
    /// `FAILED:`; a violation when `holds` is false.
    pub(crate) fn check(&mut self, holds: bool, reason: impl Into<String>) {
        self.violated |= !holds;
        self.record(holds, "FAILED", reason.into());
    }

    /// Whether a part of the run got to its end: records `reason`,
    /// prefixed `ok:` or `UNFINISHED:`; the run could not finish when
    /// `done` is false. Never a violation: for work still pending when a
    /// wait gave up, a fatal error, an output not written.
    pub(crate) fn finished(&mut self, done: bool, reason: impl Into<String>) {
        self.finished &= done;
        self.record(done, "UNFINISHED", reason.into());
    }

    /// Takes in `other`'s outcome and reasons, each reason prefixed
    /// `prefix`: a part of the run judged on its own.
    pub(crate) fn absorb(&mut self, prefix: &str, other: &Verdict) {
        self.violated |= other.violated;
        self.finished &= other.finished;
        self.ok = self.finished && !self.violated;
        self.reasons
            .extend(other.reasons.iter().map(|r| format!("{prefix}{r}")));
    }

    fn record(&mut self, held: bool, failed: &str, reason: String) {
        self.ok = self.finished && !self.violated;
        self.reasons
            .push(format!("{}: {reason}", if held { "ok" } else { failed }));
    }

    /// Ok, a violation (which wins), or a run that could not finish.
    pub fn outcome(&self) -> Outcome {
        if self.violated {
            Outcome::Violated
        } else if !self.finished {
            Outcome::Unfinished
        } else {
            Outcome::Ok
        }
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
        println!("verdict: {}", self.verdict.outcome().text());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Given the checks a run made, its outcome, exit code and printed
    /// word: a stall is not a violation, and a violation is not hidden
    /// by a stall.
    #[test]
    fn a_run_that_could_not_finish_is_neither_ok_nor_a_violation() {
        let mut v = Verdict::new();
        v.check(true, "I1: 0 duplicates");
        v.finished(true, "the pipeline drained");
        assert_eq!((v.outcome(), v.ok), (Outcome::Ok, true));
        assert_eq!(v.outcome().exit_code(), 0);

        v.finished(false, "the pipeline drained 3 of 5, then stalled");
        assert_eq!((v.outcome(), v.ok), (Outcome::Unfinished, false));
        assert_eq!((v.finished, v.violated), (false, false));
        assert_eq!(v.outcome().exit_code(), 3);
        assert_eq!(v.outcome().text(), "COULD NOT FINISH");
        v.finished(true, "a later part finished");
        assert_eq!(v.outcome(), Outcome::Unfinished, "stays unfinished");

        v.check(false, "I6: 1 observation lost");
        assert_eq!((v.outcome(), v.ok), (Outcome::Violated, false));
        assert_eq!(v.outcome().exit_code(), 1);
        assert_eq!(v.outcome().text(), "FAILED");
        assert_eq!(
            v.reasons,
            [
                "ok: I1: 0 duplicates",
                "ok: the pipeline drained",
                "UNFINISHED: the pipeline drained 3 of 5, then stalled",
                "ok: a later part finished",
                "FAILED: I6: 1 observation lost",
            ]
        );

        let mut violated_first = Verdict::new();
        violated_first.check(false, "I2: a gap");
        violated_first.finished(false, "stalled");
        assert_eq!(violated_first.outcome(), Outcome::Violated);
    }

    /// A part judged on its own passes on what it found, and nothing more.
    #[test]
    fn an_absorbed_verdict_keeps_its_outcome() {
        let mut part = Verdict::new();
        part.finished(false, "stalled");
        let mut whole = Verdict::new();
        whole.check(true, "no errors");
        whole.absorb("warm-up: ", &part);
        assert_eq!(whole.outcome(), Outcome::Unfinished);
        assert_eq!(whole.reasons[1], "warm-up: UNFINISHED: stalled");
        let mut clean = Verdict::new();
        clean.absorb("warm-up: ", &Verdict::new());
        assert_eq!(clean.outcome(), Outcome::Ok);
    }

    /// The JSON keeps `ok` and says which of the three outcomes it is.
    #[test]
    fn the_json_verdict_says_finished_and_violated() {
        let mut v = Verdict::new();
        v.finished(false, "stalled");
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["ok"], false);
        assert_eq!(json["finished"], false);
        assert_eq!(json["violated"], false);
    }
}
