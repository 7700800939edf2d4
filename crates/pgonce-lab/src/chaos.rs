//! `pgonce chaos`: an adversary that runs small concurrent workloads
//! against the safeguards under injected faults, records a history of
//! every operation, and checks it, with the tables, against the
//! invariants (the way Jepsen/Elle check a history, and PostgreSQL's
//! isolation tester drives permutations step by step).
//!
//! - One `--seed` drives everything: round `r` draws its schedule (each
//!   task's operations, their interleaving, the faults and where they hit)
//!   from an RNG seeded by (seed, r) alone (`schedule`).
//! - Each round works in a fresh scope (its own rows, entity, scope, job
//!   kind, keys and queue) of one scratch database, so rounds are
//!   independent and the checker looks at its round only.
//! - Steps run one at a time, each on its task's own connection; a step
//!   that waits on a lock is left waiting (seen in `pg_locks`) and the
//!   task's later steps wait for it (`Round::settle`). Faults hit
//!   between steps. So a schedule replays the same interleaving, and a
//!   verdict never depends on timing.
//! - A failing round is shrunk (delta debugging over its steps, replayed
//!   in fresh scopes) and saved as JSON; `--seed S --round R` or
//!   `--replay FILE` runs it again.
//!
//! Layout: `schedule` (steps, RNG, shrinking), `history`, `faults`,
//! `round` (sessions and the step driver), `stepwise.rs` (the driver of
//! scenarios that hold transactions open across steps), [`checker`], and one file per
//! scenario: `guard`, `sequence`, `jobs`, `idempotency`, `queue`, `events`, `pipeline`.

pub mod checker;
pub(crate) mod events;
pub(crate) mod faults;
pub(crate) mod guard;
pub(crate) mod history;
pub(crate) mod idempotency;
pub(crate) mod jobs;
pub(crate) mod pipeline;
pub(crate) mod queue;
pub(crate) mod round;
pub(crate) mod schedule;
pub(crate) mod sequence;
mod stepwise;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

pub(crate) use checker::Violation;
pub(crate) use faults::FaultKind;
pub(crate) use schedule::{Action, Step};

use crate::report::{Report, Row};
use crate::scratch::RunDatabase;
use round::{Round, RoundStats};

/// A workload and the invariant it attacks (`--scenario` takes a comma
/// list of these names).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum ScenarioKind {
    /// I1 through the guarded write.
    Guard,
    /// I2 through the scoped sequence.
    Sequence,
    /// I3 through leases and the reaper.
    Jobs,
    /// I4 through idempotency keys.
    Idempotency,
    /// I6 through the FIFO queue.
    Queue,
    /// I5 through conditional appends, under a strategy drawn per round.
    Events,
    /// I1, I2, I3 and I6 through the whole incident service (heavy: one
    /// round in 25 when other scenarios run too).
    Pipeline,
}

impl ScenarioKind {
    /// Every scenario, in the order a run rotates through them by default.
    pub const ALL: [ScenarioKind; 7] = [
        ScenarioKind::Guard,
        ScenarioKind::Sequence,
        ScenarioKind::Jobs,
        ScenarioKind::Idempotency,
        ScenarioKind::Queue,
        ScenarioKind::Events,
        ScenarioKind::Pipeline,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            ScenarioKind::Guard => "guard",
            ScenarioKind::Sequence => "sequence",
            ScenarioKind::Jobs => "jobs",
            ScenarioKind::Idempotency => "idempotency",
            ScenarioKind::Queue => "queue",
            ScenarioKind::Events => "events",
            ScenarioKind::Pipeline => "pipeline",
        }
    }

    fn tasks(self) -> usize {
        match self {
            ScenarioKind::Guard => guard::TASKS,
            ScenarioKind::Sequence => sequence::TASKS,
            ScenarioKind::Jobs => jobs::TASKS,
            ScenarioKind::Idempotency => idempotency::TASKS,
            ScenarioKind::Queue => queue::TASKS,
            ScenarioKind::Events => events::TASKS,
            ScenarioKind::Pipeline => pipeline::TASKS,
        }
    }

    /// The round's schedule, from its RNG.
    pub(crate) fn plan(self, seed: u64, round: u64, faults: &[FaultKind]) -> Vec<Step> {
        let rng = &mut schedule::round_rng(seed, round);
        match self {
            ScenarioKind::Guard => guard::plan(rng, faults),
            ScenarioKind::Sequence => sequence::plan(rng, faults),
            ScenarioKind::Jobs => jobs::plan(rng, faults),
            ScenarioKind::Idempotency => idempotency::plan(rng, faults),
            ScenarioKind::Queue => queue::plan(rng, faults),
            ScenarioKind::Events => events::plan(rng, faults),
            ScenarioKind::Pipeline => pipeline::plan(rng, faults),
        }
    }

    async fn run(self, round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
        match self {
            ScenarioKind::Guard => guard::run(round, steps).await,
            ScenarioKind::Sequence => sequence::run(round, steps).await,
            ScenarioKind::Jobs => jobs::run(round, steps).await,
            ScenarioKind::Idempotency => idempotency::run(round, steps).await,
            ScenarioKind::Queue => queue::run(round, steps).await,
            ScenarioKind::Events => events::run(round, steps).await,
            ScenarioKind::Pipeline => pipeline::run(round, steps).await,
        }
    }
}

/// A deliberate bug, so the checker is shown to catch real ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mutant {
    /// The guard off (rollout 0): the plain two-transaction path.
    GuardOff,
    /// The sequence taken with `SELECT ... FOR UPDATE`, which locks
    /// nothing in an empty scope.
    SequenceForUpdate,
    /// A queue delete by message id that ignores the receipt's generation.
    QueueStaleDelete,
    /// A writer with no condition that inserts into the event log directly,
    /// taking none of the strategy's publishing keys.
    EventsRawInsert,
    /// A reaper that deletes a job whose lease ran out instead of
    /// returning it to pending, and counts it as returned.
    JobsReaperDelete,
}

/// How long a recovery took (a restart until an operation succeeded).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Recovery {
    pub(crate) after: &'static str,
    pub(crate) millis: u64,
}

/// `pgonce chaos`.
#[derive(Debug, Clone, clap::Args)]
pub struct ChaosArgs {
    /// Rounds to run; they rotate through the scenarios.
    #[arg(long, default_value_t = 100)]
    pub(crate) rounds: u64,
    /// The seed every round's schedule derives from (default: from the
    /// clock; the report prints it).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Stop starting rounds after this long ("90s", "10m").
    #[arg(long, value_parser = humantime::parse_duration)]
    pub(crate) duration: Option<Duration>,
    /// Faults to inject (comma list; default all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) faults: Vec<FaultKind>,
    /// Scenarios to run (comma list; default all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) scenario: Vec<ScenarioKind>,
    /// Run only this round of --seed (its scenario from the rotation of
    /// --scenario), to replay a failure.
    #[arg(long, requires = "seed")]
    pub(crate) round: Option<u64>,
    /// Replay a saved failing round (its shrunk schedule) from this file.
    #[arg(long, conflicts_with = "round")]
    pub(crate) replay: Option<PathBuf>,
    /// Where failing rounds are saved.
    #[arg(long, default_value = "target/chaos-failures")]
    pub(crate) failures_dir: PathBuf,
    /// A deliberate bug to inject (for testing the checker).
    #[arg(long, value_enum, hide = true)]
    pub(crate) mutant: Option<Mutant>,
}

/// What a run does; [`ChaosArgs`] builds one, tests build their own.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub(crate) rounds: u64,
    pub(crate) seed: u64,
    pub(crate) duration: Option<Duration>,
    pub(crate) faults: Vec<FaultKind>,
    /// Scenarios to rotate through (the pipeline only once every
    /// `pipeline::EVERY` rounds).
    pub scenarios: Vec<ScenarioKind>,
    /// Only this round.
    pub round: Option<u64>,
    /// Replay this saved round instead.
    pub replay: Option<SavedRound>,
    /// `None`: failing rounds are not saved.
    pub failures_dir: Option<PathBuf>,
    /// A deliberate bug to inject, to show the checker catches it; `None` in
    /// a real run.
    pub mutant: Option<Mutant>,
    /// Replays the shrinker may spend on one failing round.
    pub(crate) shrink_budget: usize,
    /// Stop at the first failing round.
    pub stop_at_first: bool,
    pub(crate) progress: bool,
    /// The `pgonce` executable, for the `worker-kill` fault's child
    /// processes; `None` leaves that fault out.
    pub(crate) worker_program: Option<PathBuf>,
}

impl ChaosConfig {
    /// A run of `rounds` rounds from `seed`, over every scenario and every
    /// fault but `worker-kill` (no `pgonce` executable to run): no time
    /// limit, failing rounds shrunk but not saved.
    pub fn new(seed: u64, rounds: u64) -> ChaosConfig {
        ChaosConfig {
            rounds,
            seed,
            duration: None,
            faults: FaultKind::ALL.to_vec(),
            scenarios: ScenarioKind::ALL.to_vec(),
            round: None,
            replay: None,
            failures_dir: None,
            mutant: None,
            shrink_budget: 24,
            stop_at_first: false,
            progress: false,
            worker_program: None,
        }
    }

    /// The scenario of round `round`: the selected ones in rotation, the
    /// heavy pipeline only once every `pipeline::EVERY` rounds (every
    /// round when it is the only one).
    pub(crate) fn scenario_of(&self, round: u64) -> ScenarioKind {
        let light: Vec<ScenarioKind> = self
            .scenarios
            .iter()
            .copied()
            .filter(|s| *s != ScenarioKind::Pipeline)
            .collect();
        let pipeline = self.scenarios.contains(&ScenarioKind::Pipeline);
        if pipeline && (light.is_empty() || round % pipeline::EVERY == pipeline::EVERY - 1) {
            return ScenarioKind::Pipeline;
        }
        light[(round % light.len() as u64) as usize]
    }
}

/// A failing round as saved: enough to replay it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedRound {
    /// The run's seed; with `round`, it rebuilds the round's schedule.
    pub seed: u64,
    /// The round's number within its run.
    pub round: u64,
    pub(crate) scenario: ScenarioKind,
    /// The deliberate bug the run injected, if any; a replay injects it
    /// again.
    pub mutant: Option<Mutant>,
    pub(crate) invariant: String,
    pub(crate) detail: String,
    /// The shortest schedule found that still shows the violation.
    pub schedule: Vec<Step>,
    /// How many steps the round's schedule had before shrinking.
    pub(crate) original_steps: usize,
}

/// A violation found by a run.
#[derive(Debug, Clone, Serialize)]
pub struct Found {
    pub(crate) seed: u64,
    /// The round that broke it.
    pub round: u64,
    pub(crate) scenario: ScenarioKind,
    /// The invariant broken, and how.
    pub violation: Violation,
    /// The shortest schedule found that still shows a violation.
    pub shrunk: Vec<Step>,
    /// How many steps the round's schedule had before shrinking.
    pub original_steps: usize,
    /// Where the round was saved for `--replay`; `None` when saving is off.
    pub saved: Option<PathBuf>,
}

/// What a run saw.
#[derive(Debug, Clone, Default)]
pub struct ChaosOutcome {
    pub(crate) seed: u64,
    /// Rounds run, per scenario.
    pub rounds: BTreeMap<ScenarioKind, u64>,
    pub(crate) operations: BTreeMap<ScenarioKind, u64>,
    /// Faults injected, per kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Every violation found, one entry each.
    pub found: Vec<Found>,
    pub(crate) recoveries: Vec<Recovery>,
    pub(crate) elapsed: Duration,
}

/// The command: a scratch database, the rounds, a report.
pub async fn run(args: &ChaosArgs, database_url: Option<&str>) -> anyhow::Result<Report> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_micros() as u64)
    });
    let mut config = ChaosConfig::new(seed, args.rounds);
    config.duration = args.duration;
    if !args.faults.is_empty() {
        config.faults = args.faults.clone();
    }
    if !args.scenario.is_empty() {
        config.scenarios = args.scenario.clone();
    }
    config.round = args.round;
    config.failures_dir = Some(args.failures_dir.clone());
    config.mutant = args.mutant;
    config.progress = true;
    // This process is `pgonce` itself: the worker-kill fault starts
    // `pgonce worker` children from it.
    config.worker_program = std::env::current_exe().ok();
    if let Some(path) = &args.replay {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let saved: SavedRound =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        config.seed = saved.seed;
        config.mutant = saved.mutant;
        config.replay = Some(saved);
    }
    let db = RunDatabase::open(database_url, "chaos", 8).await?;
    let outcome = run_on(&db, &config).await;
    let environment = db.environment().await;
    db.close().await?;
    let outcome = outcome?;
    Ok(report(&config, &outcome, environment?))
}

/// Runs `config` on `db` (tests call this on their own database).
pub async fn run_on(db: &RunDatabase, config: &ChaosConfig) -> anyhow::Result<ChaosOutcome> {
    anyhow::ensure!(!config.scenarios.is_empty(), "no scenario selected");
    sqlx::raw_sql(include_str!("chaos/sql/schema.sql"))
        .execute(db.pool())
        .await
        .context("creating the chaos tables")?;
    crate::scenario::guard::create_schema(db.pool())
        .await
        .context("creating the guard scenario's table")?;
    crate::scenario::sequence::create_schema(db.pool())
        .await
        .context("creating the sequence scenario's tables")?;
    let started = Instant::now();
    let mut outcome = ChaosOutcome {
        seed: config.seed,
        ..ChaosOutcome::default()
    };
    let rounds: Vec<(u64, ScenarioKind, Option<Vec<Step>>)> = match (&config.replay, config.round) {
        (Some(saved), _) => vec![(saved.round, saved.scenario, Some(saved.schedule.clone()))],
        (None, Some(r)) => vec![(r, config.scenario_of(r), None)],
        (None, None) => (0..config.rounds)
            .map(|r| (r, config.scenario_of(r), None))
            .collect(),
    };
    let bar = if config.progress {
        ProgressBar::with_draw_target(Some(rounds.len() as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("chaos {bar:30} {pos}/{len} rounds, {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    for (round, scenario, steps) in rounds {
        if config.duration.is_some_and(|d| started.elapsed() >= d) {
            break;
        }
        let steps = steps.unwrap_or_else(|| scenario.plan(config.seed, round, &config.faults));
        let played = play(db, config, scenario, round, &steps).await?;
        *outcome.rounds.entry(scenario).or_default() += 1;
        *outcome.operations.entry(scenario).or_default() += played.operations as u64;
        for (kind, n) in &played.stats.faults {
            *outcome.faults.entry(*kind).or_default() += n;
        }
        outcome
            .recoveries
            .extend(played.stats.recoveries.iter().cloned());
        if let Some(first) = played.violations.first().cloned() {
            let invariant = first.invariant;
            let shrunk = if config.replay.is_some() {
                steps.clone()
            } else {
                schedule::shrink(
                    steps.clone(),
                    config.shrink_budget,
                    async |candidate: &[Step]| {
                        play(db, config, scenario, round, candidate)
                            .await
                            .is_ok_and(|p| p.violations.iter().any(|v| v.invariant == invariant))
                    },
                )
                .await
            };
            let saved = match &config.failures_dir {
                Some(dir) if config.replay.is_none() => Some(save(
                    dir,
                    config,
                    scenario,
                    round,
                    &first,
                    &shrunk,
                    steps.len(),
                )?),
                _ => None,
            };
            for violation in played.violations {
                outcome.found.push(Found {
                    seed: config.seed,
                    round,
                    scenario,
                    violation,
                    shrunk: shrunk.clone(),
                    original_steps: steps.len(),
                    saved: saved.clone(),
                });
            }
        }
        bar.inc(1);
        bar.set_message(format!("{} violations", outcome.found.len()));
        if config.stop_at_first && !outcome.found.is_empty() {
            break;
        }
    }
    bar.finish_and_clear();
    outcome.elapsed = started.elapsed();
    Ok(outcome)
}

/// What one play of a round left.
pub(crate) struct Played {
    pub(crate) violations: Vec<Violation>,
    pub(crate) operations: usize,
    pub(crate) stats: RoundStats,
}

/// Plays `steps` as round `round` of `scenario` in a fresh scope, then
/// checks it.
pub(crate) async fn play(
    db: &RunDatabase,
    config: &ChaosConfig,
    scenario: ScenarioKind,
    round: u64,
    steps: &[Step],
) -> anyhow::Result<Played> {
    let scope = format!(
        "r{round}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    // One restarter per restart in the schedule (each is used once);
    // none on a server that is not the run's own throwaway cluster.
    let restarts = steps
        .iter()
        .filter(|s| {
            matches!(
                s.action,
                Action::Fault {
                    fault: FaultKind::Restart,
                    ..
                }
            )
        })
        .count();
    let restarters = (0..restarts).filter_map(|_| db.restarter()).collect();
    let mut r = Round::open(
        &db.options(),
        db.pool().clone(),
        scope,
        scenario.tasks(),
        config.mutant,
        restarters,
    )
    .await?;
    r.worker_program = config.worker_program.clone();
    let ran = scenario.run(&mut r, steps).await;
    let violations = match ran {
        Ok(()) => checker::check(scenario, &r).await?,
        Err(e) => vec![Violation {
            invariant: "the round ran to its end",
            detail: format!("{e:#}"),
        }],
    };
    let played = Played {
        violations,
        operations: r.history.operations(),
        stats: r.stats.clone(),
    };
    r.close().await;
    Ok(played)
}

fn save(
    dir: &Path,
    config: &ChaosConfig,
    scenario: ScenarioKind,
    round: u64,
    violation: &Violation,
    shrunk: &[Step],
    original_steps: usize,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("seed-{}-round-{round}.json", config.seed));
    let saved = SavedRound {
        seed: config.seed,
        round,
        scenario,
        mutant: config.mutant,
        invariant: violation.invariant.to_string(),
        detail: violation.detail.clone(),
        schedule: shrunk.to_vec(),
        original_steps,
    };
    std::fs::write(&path, serde_json::to_string_pretty(&saved)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

fn report(
    config: &ChaosConfig,
    outcome: &ChaosOutcome,
    environment: crate::report::Environment,
) -> Report {
    let mut report = Report::new("chaos", &format!("seed {}", outcome.seed), environment);
    for scenario in &config.scenarios {
        let violations = outcome
            .found
            .iter()
            .filter(|f| f.scenario == *scenario)
            .count();
        report.results.push(
            Row::new(scenario.name())
                .with("rounds", outcome.rounds.get(scenario).copied().unwrap_or(0))
                .with(
                    "operations",
                    outcome.operations.get(scenario).copied().unwrap_or(0),
                )
                .with("violations", violations)
                .with("invariant_held", violations == 0),
        );
    }
    let faults = FaultKind::ALL
        .iter()
        .filter(|k| config.faults.contains(k))
        .map(|k| Row::new(k.name()).with("injected", outcome.faults.get(k).copied().unwrap_or(0)))
        .collect();
    report.sections.insert("faults".into(), faults);
    let mut per_invariant: BTreeMap<&str, usize> = BTreeMap::new();
    for f in &outcome.found {
        *per_invariant.entry(f.violation.invariant).or_default() += 1;
    }
    if !outcome.found.is_empty() {
        report.sections.insert(
            "violations".into(),
            outcome
                .found
                .iter()
                .map(|f| {
                    Row::new(f.scenario.name())
                        .with("seed", f.seed)
                        .with("round", f.round)
                        .with("invariant", f.violation.invariant)
                        .with("detail", &f.violation.detail)
                        .with(
                            "steps",
                            format!("{} of {}", f.shrunk.len(), f.original_steps),
                        )
                        .with("saved", f.saved.as_ref().map(|p| p.display().to_string()))
                })
                .collect(),
        );
    }
    let mut millis: Vec<u64> = outcome.recoveries.iter().map(|r| r.millis).collect();
    millis.sort_unstable();
    if !millis.is_empty() {
        report.sections.insert(
            "recoveries".into(),
            vec![
                Row::new("restart")
                    .with("count", millis.len())
                    .with("median_ms", millis[millis.len() / 2])
                    .with("max_ms", millis[millis.len() - 1]),
            ],
        );
    }
    let rounds: u64 = outcome.rounds.values().sum();
    report.ratios.insert(
        "elapsed_s".into(),
        (outcome.elapsed.as_secs_f64() * 10.0).round() / 10.0,
    );
    report.verdict.check(
        outcome.found.is_empty(),
        format!(
            "{rounds} rounds, {} operations, {} faults: {} violations{}",
            outcome.operations.values().sum::<u64>(),
            outcome.faults.values().sum::<u64>(),
            outcome.found.len(),
            per_invariant
                .iter()
                .map(|(k, v)| format!("; {k}: {v}"))
                .collect::<String>()
        ),
    );
    for f in outcome.found.iter().take(10) {
        report.verdict.reasons.push(format!(
            "replay: pgonce chaos --seed {} --round {} --scenario {}{}",
            f.seed,
            f.round,
            f.scenario.name(),
            f.saved
                .as_ref()
                .map(|p| format!(" (or --replay {})", p.display()))
                .unwrap_or_default()
        ));
    }
    report
}
