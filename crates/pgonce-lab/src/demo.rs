//! `pgonce demo`: the incident service end to end on a throwaway database,
//! under the faults it exists for, then every invariant checked in the
//! database.
//!
//! The run: organizations, entities and policies (a singleton, a
//! non-singleton, and one decided per entity at run time); a local webhook
//! receiver that sometimes fails and sometimes answers too late; observations
//! produced onto the FIFO queue with injected duplicate sends; a visibility
//! timeout shorter than the slow tail of the evaluation, so the slow
//! messages are delivered again while their first worker is still busy;
//! people declaring, acknowledging and resolving incidents by hand; and,
//! part-way, one worker runtime killed (its tasks aborted mid-message; its
//! messages and claimed notifications must come back); with `--restart-at`,
//! the database server restarted mid-run. The run itself is
//! [`crate::incident_run`]; this module renders its outcome. The report counts
//! what happened and checks I1, I2, I3 and I6, telling violations apart
//! from work still pending at the deadline; the exit code is 0 iff all
//! hold.

use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::behind_pooler::{BehindPooler, ListenMode};
use crate::incident_run::{self, IncidentRunConfig, IncidentRunOutcome};
use crate::report::{Environment, Report, Row};
use crate::scratch::RunDatabase;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Percent of entities whose incidents take the guarded write; the rest
    /// take the plain two-transaction path. 0 shows what breaks without it.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u8).range(0..=100))]
    rollout: u8,
    /// Observations to produce.
    #[arg(long, default_value_t = 1500)]
    observations: usize,
    /// Organizations (each with its entities and three policies).
    #[arg(long, default_value_t = 3)]
    organizations: usize,
    /// Entities per organization.
    #[arg(long, default_value_t = 25)]
    entities: usize,
    /// Share of observations sent twice by the producer (same
    /// deduplication id: the queue drops the second).
    #[arg(long, default_value_t = 0.1)]
    duplicates: f64,
    /// The queue's visibility timeout, in ms: shorter than the slow tail of
    /// the evaluation.
    #[arg(long, default_value_t = 1000)]
    visibility_ms: u64,
    /// Share of policy evaluations that take longer than the visibility
    /// timeout (the message is then delivered again while still being
    /// evaluated).
    #[arg(long, default_value_t = 0.05)]
    slow_rate: f64,
    /// No people declaring, acknowledging and resolving by hand (so every
    /// duplicate the pipeline makes stays OPEN for the check).
    #[arg(long)]
    no_people: bool,
    /// Give up waiting for the pipeline after this many seconds.
    #[arg(long, default_value_t = 100)]
    deadline_secs: u64,
    /// Restart the throwaway PostgreSQL cluster (a fast shutdown, as
    /// `pg_ctl restart -m fast`) this many seconds into the run: every
    /// session is cut off mid-work, and the run must still end with every
    /// invariant checked. Needs the throwaway cluster (no --database-url).
    #[arg(long, value_name = "SECONDS")]
    restart_at: Option<f64>,
    /// Run every pool (pipeline, people, notifier, maintenance) through a
    /// PgBouncer in transaction mode that the demo starts in front of the
    /// database and stops at the end (the binary: PGONCE_PGBOUNCER or
    /// `pgbouncer` on the PATH, 1.21 or newer; scripts/ensure-pgbouncer.sh
    /// builds one).
    #[arg(long)]
    pooler: bool,
    /// Where the queue's long polls LISTEN: `direct` (a direct connection,
    /// around the pooler), `off` (polling only) or `pool`. Default: `direct`
    /// with --pooler, else `pool`.
    #[arg(long, value_enum)]
    listen: Option<ListenMode>,
}

impl DemoArgs {
    fn run_config(&self) -> IncidentRunConfig {
        let mut c = IncidentRunConfig::demo(
            Duration::from_millis(self.visibility_ms),
            self.slow_rate,
            Duration::from_millis(500),
        );
        c.rollout = self.rollout;
        c.observations = self.observations;
        c.organizations = self.organizations;
        c.entities = self.entities;
        c.duplicates = self.duplicates;
        c.people = !self.no_people;
        c.drain_deadline = Duration::from_secs(self.deadline_secs);
        c
    }
}

/// Runs the demo. A fatal error (the database gone for good, bad
/// arguments) still ends in a report, whose verdict says what failed, so
/// that `--json` prints one JSON object on every exit path but Ctrl-C; the
/// scratch database is dropped on every path (see [`RunDatabase`]).
pub async fn run(args: &DemoArgs, database_url: Option<&str>) -> anyhow::Result<Report> {
    let mut environment = None;
    match run_checked(args, database_url, &mut environment).await {
        Ok(report) => Ok(report),
        Err(e) => Ok(fatal_report(&e, environment)),
    }
}

/// The report of a run that could not finish: `error` in its verdict.
pub fn fatal_report(error: &anyhow::Error, environment: Option<Environment>) -> Report {
    let mut report = Report::new(
        "demo",
        "incident-service",
        environment.unwrap_or_else(Environment::unknown),
    );
    report
        .verdict
        .check(false, format!("the demo could not finish: {error:#}"));
    report
}

async fn run_checked(
    args: &DemoArgs,
    database_url: Option<&str>,
    environment: &mut Option<Environment>,
) -> anyhow::Result<Report> {
    let mut config = args.run_config();
    let restart_at = match args.restart_at {
        Some(s) if !(s.is_finite() && s >= 0.0) => {
            anyhow::bail!("--restart-at must be a number of seconds, at least 0")
        }
        Some(s) => Some(Duration::from_secs_f64(s)),
        None => None,
    };
    let db = RunDatabase::open(database_url, "demo", 40).await?;
    *environment = Some(db.environment().await?);
    let restart = match restart_at {
        None => None,
        Some(at) => match db.restarter() {
            Some(restarter) => Some((at, restarter)),
            None => anyhow::bail!(
                "--restart-at restarts the throwaway cluster; it cannot restart the server \
                 --database-url names"
            ),
        },
    };
    let bar = ProgressBar::new(config.observations as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} observations {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix("pipeline");
    let listen = args.listen.unwrap_or(match args.pooler {
        true => ListenMode::Direct,
        false => ListenMode::Pool,
    });
    config.listen = listen.listen(&db);
    let pooler = match args.pooler {
        true => Some(BehindPooler::start(&db, 40).await?),
        false => None,
    };
    let pool = pooler.as_ref().map_or(db.pool(), BehindPooler::pool);
    let outcome = incident_run::run(pool, &config, restart, Some(&bar)).await;
    bar.finish_and_clear();
    let outcome = outcome?;
    let mut report = render(
        &outcome,
        args.rollout,
        environment.clone().expect("read above"),
    );
    report.results.push(
        Row::new("run")
            .with("figure", "connections")
            .with("value", connections(args.pooler, listen)),
    );
    if let Some(pooler) = pooler {
        pooler.close().await;
    }
    db.close().await?;
    Ok(report)
}

/// How the run reached PostgreSQL, for its report.
fn connections(pooler: bool, listen: ListenMode) -> String {
    let pools = match pooler {
        true => "through PgBouncer (transaction mode)",
        false => "direct",
    };
    let listen = match listen {
        ListenMode::Pool => "on a pooled connection",
        ListenMode::Direct => "on a direct connection",
        ListenMode::Off => "off (polling)",
    };
    format!("{pools}; LISTEN {listen}")
}

/// At most this many pending jobs or messages are listed in a verdict.
const LISTED: usize = 5;

/// The demo's report of an incident run: its figures, the invariants, and a
/// verdict that separates violations from work still pending at the
/// deadline.
pub fn render(outcome: &IncidentRunOutcome, rollout: u8, environment: Environment) -> Report {
    let o = outcome;
    let checked = &o.invariants;
    let expected = o.produced.sent.len() as u64;
    let mut report = Report::new("demo", "incident-service", environment);
    let mut figures: Vec<(&str, &str, serde_json::Value)> = vec![
        ("pipeline", "observations sent", expected.into()),
        (
            "pipeline",
            "duplicate sends (same dedup id)",
            o.produced.duplicate_sends.into(),
        ),
        (
            "pipeline",
            "dropped by the queue's dedup",
            o.produced.dropped_by_dedup.into(),
        ),
        ("pipeline", "deliveries handled", o.pipeline.messages.into()),
        ("pipeline", "redeliveries", o.pipeline.redeliveries.into()),
        ("pipeline", "acks refused as stale", o.workers.stale.into()),
        (
            "pipeline",
            "evaluation failures (retried)",
            o.pipeline.evaluation_failures.into(),
        ),
        (
            "incidents",
            "opened by the pipeline",
            o.pipeline.incidents_opened.into(),
        ),
        (
            "incidents",
            "guarded writes",
            o.pipeline.guarded_writes.into(),
        ),
        ("incidents", "plain writes", o.pipeline.plain_writes.into()),
        (
            "incidents",
            "conflicts caught by the guard",
            o.pipeline.conflicts.into(),
        ),
        (
            "incidents",
            "violations already open",
            o.pipeline.already_open.into(),
        ),
        (
            "incidents",
            "opened twice for one message",
            o.tallies.opened_twice_for_one_message.into(),
        ),
        (
            "incidents",
            "declared/acked/resolved by people",
            o.human_actions.into(),
        ),
        ("incidents", "total", o.tallies.incidents.into()),
        (
            "notifications",
            "notified (one row per incident)",
            o.tallies.notifications.into(),
        ),
        (
            "notifications",
            "webhook requests",
            o.receiver.requests.into(),
        ),
        (
            "notifications",
            "duplicates dropped by idempotency key",
            o.receiver.duplicates.into(),
        ),
        (
            "notifications",
            "refused by the receiver (500)",
            o.receiver.refused.into(),
        ),
        (
            "notifications",
            "answered after the sender's timeout",
            o.receiver.late.into(),
        ),
        (
            "notifications",
            "settle bound (s)",
            round1(o.settle_bound.as_secs_f64()).into(),
        ),
        (
            "queue",
            "malformed messages sent",
            o.produced.malformed.into(),
        ),
        (
            "queue",
            "dead-lettered",
            o.observations.dead_lettered.into(),
        ),
        (
            "queue",
            "left in the queue",
            (o.queue.depth + o.queue.in_flight).into(),
        ),
        ("run", "guard rollout (percent)", rollout.into()),
    ];
    if let Some(r) = &o.restart {
        figures.push(("run", "database restarted at (s)", round1(r.at_secs).into()));
        figures.push(("run", "restart took (s)", round1(r.took_secs).into()));
    }
    figures.push((
        "run",
        "database calls retried by the drivers",
        o.driver_retries.into(),
    ));
    figures.push(("run", "seconds", round1(o.elapsed.as_secs_f64()).into()));
    for (area, figure, value) in figures {
        report
            .results
            .push(Row::new(area).with("figure", figure).with("value", value));
    }
    let invariant_rows = vec![
        Row::new("I1")
            .with(
                "invariant",
                "a singleton policy never has two OPEN incidents for one entity",
            )
            .with("held", checked.i1())
            .with("violations", checked.i1_duplicate_open.len()),
        Row::new("I2")
            .with("invariant", "incident numbers are 1..n per organization")
            .with("held", checked.i2())
            .with("violations", checked.i2_number_gaps.len()),
        Row::new("I3")
            .with("invariant", "each incident is notified exactly once")
            .with("held", o.notifications.holds() && checked.i3())
            .with(
                "violations",
                o.notifications.more_than_once.len() + o.notifications.never_enqueued_or_lost.len(),
            )
            .with("pending", o.notifications.pending_at_deadline.len()),
        Row::new("I6")
            .with("invariant", "no observation lost")
            .with("held", o.observations.holds() && checked.i6())
            .with("violations", o.observations.lost.len())
            .with("pending", o.observations.pending_at_deadline.len()),
    ];
    report.sections.insert("invariants".into(), invariant_rows);
    let pending_jobs: Vec<Row> = o
        .notifications
        .pending_at_deadline
        .iter()
        .map(|j| {
            Row::new(format!("job {}", j.job_id))
                .with("incident", j.incident_id)
                .with("state", &j.status)
                .with("why", j.why_pending())
        })
        .collect();
    if !pending_jobs.is_empty() {
        report
            .sections
            .insert("notifications pending at the deadline".into(), pending_jobs);
    }

    let v = &mut report.verdict;
    if let Some(r) = &o.restart {
        v.check(
            r.error.is_none(),
            format!(
                "the database restarted {:.1} s in ({:.1} s){}; the drivers retried {} calls",
                r.at_secs,
                r.took_secs,
                r.error
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default(),
                o.driver_retries
            ),
        );
    }
    v.check(
        o.drained,
        format!(
            "the pipeline drained within {} s",
            o.drain_deadline.as_secs()
        ),
    );
    v.check(
        checked.i1(),
        format!(
            "I1: {} incidents opened while another of their singleton (policy, entity) was OPEN{}",
            checked.i1_duplicate_open.len(),
            if rollout < 100 {
                format!(" (rollout {rollout}%: the plain path has no guard)")
            } else {
                String::new()
            }
        ),
    );
    v.check(
        checked.i2(),
        format!(
            "I2: {} organizations with gaps or duplicates",
            checked.i2_number_gaps.len()
        ),
    );
    let n = &o.notifications;
    v.check(
        n.more_than_once.is_empty(),
        format!(
            "I3: {} incidents notified more than once; the receiver dropped {} duplicate deliveries by key",
            n.more_than_once.len(),
            o.receiver.duplicates
        ),
    );
    v.check(
        n.never_enqueued_or_lost.is_empty(),
        format!(
            "I3: {} incidents never enqueued for notification or lost (job dead or missing){}",
            n.never_enqueued_or_lost.len(),
            listed(n.never_enqueued_or_lost.iter().map(|(i, job)| match job {
                None => format!("incident {}: no job", i.incident_id),
                Some(j) => format!(
                    "incident {}: job {} {}{}",
                    i.incident_id,
                    j.job_id,
                    j.status,
                    j.last_error
                        .as_deref()
                        .map(|e| format!(" ({e})"))
                        .unwrap_or_default()
                ),
            }))
        ),
    );
    v.check(
        n.pending_at_deadline.is_empty(),
        format!(
            "I3: {} notification jobs still pending at the deadline ({:.1} s after the pipeline stopped, \
             from the lease, the retry schedule and the attempts){}",
            n.pending_at_deadline.len(),
            o.settle_bound.as_secs_f64(),
            listed(n.pending_at_deadline.iter().map(|j| format!(
                "job {} (incident {}): {}",
                j.job_id,
                j.incident_id,
                j.why_pending()
            )))
        ),
    );
    let obs = &o.observations;
    v.check(
        obs.lost.is_empty(),
        format!(
            "I6: {} of {} observations lost (deleted unprocessed, or dead-lettered though valid){}",
            obs.lost.len(),
            expected,
            listed(obs.lost.iter().map(|m| format!(
                "message {}: {}",
                m.message_id,
                m.queue.as_deref().unwrap_or("deleted")
            )))
        ),
    );
    v.check(
        obs.pending_at_deadline.is_empty(),
        format!(
            "I6: {} observations still in the queue at the deadline{}",
            obs.pending_at_deadline.len(),
            listed(obs.pending_at_deadline.iter().map(|m| format!(
                "message {}: {}, received {} times",
                m.message_id,
                if m.in_flight == Some(true) {
                    "in flight"
                } else {
                    "visible"
                },
                m.receive_count.unwrap_or(0)
            )))
        ),
    );
    v.check(
        obs.malformed_dead_lettered == obs.malformed_sent,
        format!(
            "queue: {} of {} malformed messages in the dead-letter queue ({} there in all)",
            obs.malformed_dead_lettered, obs.malformed_sent, obs.dead_lettered
        ),
    );
    report
}

/// `: a; b; c (and 4 more)`, or nothing when `items` is empty.
fn listed(items: impl Iterator<Item = String>) -> String {
    let all: Vec<String> = items.collect();
    if all.is_empty() {
        return String::new();
    }
    let more = all.len().saturating_sub(LISTED);
    let shown = all.into_iter().take(LISTED).collect::<Vec<_>>().join("; ");
    if more > 0 {
        format!(": {shown} (and {more} more)")
    } else {
        format!(": {shown}")
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
