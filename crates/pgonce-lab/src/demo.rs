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
//! the database server restarted mid-run. With `--queue sqs` the
//! observations go through Amazon SQS instead, on a local moto server the
//! demo starts and stops, and the report says which safeguard keeps each
//! invariant where SQS is weaker than the PostgreSQL queue. The run itself is
//! [`crate::incident_run`]; this module renders its outcome. The report counts
//! what happened and checks I1, I2, I3 and I6, telling violations apart
//! from work still pending at the deadline; the exit code is 0 when all
//! hold and the run finished, 1 on a violation, 3 when the run could not
//! finish (a stall, a fatal error) with no violation seen.

use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use pgonce_incidents::config::SqsSection;
use pgonce_incidents::runtime::sqs_observations_queue;
use pgonce_sqs::{SqsClient, SqsConfig};
use pgonce_testkit::Moto;

use crate::behind_pooler::{BehindPooler, ListenMode};
use crate::incident_run::{self, IncidentRunConfig, IncidentRunOutcome, SqsAudit};
use crate::report::{Environment, Report, Row};
use crate::scratch::RunDatabase;

/// Where the demo's observations are queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum QueueChoice {
    /// The PostgreSQL queue, in the demo's database.
    Postgres,
    /// Amazon SQS's protocol, on a local moto server the demo starts (and
    /// stops); moto must be installed (scripts/ensure-moto.sh).
    Sqs,
}

/// `pgonce demo`'s arguments: the queue, the guard's rollout, the load
/// and the faults the run is put under.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The observations queue: `postgres`, or `sqs` on a local moto server.
    #[arg(long, value_enum, default_value_t = QueueChoice::Postgres)]
    queue: QueueChoice,
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
    /// Give up waiting for the pipeline after this many seconds without
    /// progress (a slow machine drains later; only a stall fails). Default
    /// 100; 300 with `--queue sqs` (a local moto server answers far slower
    /// than PostgreSQL, and each malformed message needs
    /// `max_receive_count` deliveries before SQS dead-letters it).
    #[arg(long)]
    deadline_secs: Option<u64>,
    /// Restart the throwaway PostgreSQL cluster (a fast shutdown, as
    /// `pg_ctl restart -m fast`) this many seconds into the run: every
    /// session is cut off mid-work, and the run must still end with every
    /// invariant checked. Needs the throwaway cluster (no --database-url).
    #[arg(long, value_name = "SECONDS")]
    restart_at: Option<f64>,
    /// Run every pool (pipeline, people, notifier, maintenance) through a
    /// PgBouncer in transaction mode that the demo starts in front of the
    /// database and stops at the end (the binary: PGBOUNCER_BIN or
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
        let deadline = match self.queue {
            QueueChoice::Postgres => 100,
            QueueChoice::Sqs => 300,
        };
        c.drain_deadline = Duration::from_secs(self.deadline_secs.unwrap_or(deadline));
        match self.queue {
            QueueChoice::Postgres => c,
            QueueChoice::Sqs => c.whole_second_visibility(),
        }
    }
}

/// The longest `--deadline-secs` and `--restart-at`: a day.
const MAX_SECONDS: f64 = 86_400.0;

/// Runs the demo. A fatal error (the database gone for good, bad
/// arguments) still ends in a report, whose verdict says the run could not
/// finish and why (exit 3, not a violation), so
/// that `--json` prints one JSON object on every exit path but Ctrl-C; the
/// scratch database is dropped on every path (see [`RunDatabase`]).
pub async fn run(args: &DemoArgs, database_url: Option<&str>) -> anyhow::Result<Report> {
    let mut environment = None;
    match run_checked(args, database_url, &mut environment).await {
        Ok(report) => Ok(report),
        Err(e) => Ok(fatal_report(&e, environment)),
    }
}

/// The report of a run that could not finish: `error` in its verdict, which
/// is unfinished, not violated.
pub(crate) fn fatal_report(error: &anyhow::Error, environment: Option<Environment>) -> Report {
    let mut report = Report::new(
        "demo",
        "incident-service",
        environment.unwrap_or_else(Environment::unknown),
    );
    report
        .verdict
        .finished(false, format!("the demo could not finish: {error:#}"));
    report
}

async fn run_checked(
    args: &DemoArgs,
    database_url: Option<&str>,
    environment: &mut Option<Environment>,
) -> anyhow::Result<Report> {
    let mut config = args.run_config();
    // Checked here rather than by clap, so that --json still prints a
    // report; bounded, because each is added to a clock.
    if args
        .deadline_secs
        .is_some_and(|d| d == 0 || d > MAX_SECONDS as u64)
    {
        anyhow::bail!("--deadline-secs must be 1 to {MAX_SECONDS}");
    }
    let restart_at = match args.restart_at {
        Some(s) if !(s.is_finite() && (0.0..=MAX_SECONDS).contains(&s)) => {
            anyhow::bail!("--restart-at must be a number of seconds, 0 to {MAX_SECONDS}")
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
    let outcome = match args.queue {
        QueueChoice::Postgres => incident_run::run(pool, &config, restart, Some(&bar)).await,
        QueueChoice::Sqs => run_on_moto(pool, &config, restart, &bar).await,
    };
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

/// The incident run with its observations on SQS: a moto server started
/// here and stopped when the run ends (on every path: [`Moto`] stops it
/// when dropped), the FIFO observations queue and its dead-letter queue
/// created on it as `pgonce serve` creates them from `[queue.sqs]`.
async fn run_on_moto(
    pool: &sqlx::PgPool,
    config: &IncidentRunConfig,
    restart: Option<(Duration, crate::scratch::Restarter)>,
    bar: &ProgressBar,
) -> anyhow::Result<IncidentRunOutcome> {
    let moto = tokio::task::spawn_blocking(Moto::start)
        .await
        .context("starting moto")??;
    bar.println(format!(
        "demo: SQS on a local moto server at {}",
        moto.endpoint()
    ));
    let sqs = SqsClient::connect(SqsConfig::local(moto.endpoint())).await?;
    let section = SqsSection::default();
    let observations =
        sqs_observations_queue(&sqs, &section, config.visibility, config.max_receive_count).await?;
    let dead_letters = sqs.open(section.dead_letter_name()).await?;
    let audit = SqsAudit {
        observations: observations.clone(),
        dead_letters,
    };
    let outcome = incident_run::run_on(pool, config, observations, audit, restart, Some(bar)).await;
    drop(moto);
    outcome
}

/// Which safeguard keeps each invariant on each queue: the same database
/// safeguards on both, and on SQS they also carry what SQS does not do
/// (fence stale receipts, deduplicate past 5 minutes).
fn kept_by(backend: &str, invariant: &str) -> &'static str {
    match (backend, invariant) {
        ("sqs", "I1") => {
            "the guarded write alone: SQS lets a stale receipt delete, so a redelivery and its \
             first delivery both evaluate and both reach the guard; the re-read under the \
             entity lock lets one open"
        }
        (_, "I1") => "the guarded write (entity lock, re-read, compare)",
        (_, "I2") => "the per-organization sequence, number taken last (no queue involved)",
        (_, "I3") => {
            "the notification job enqueued with the incident, in PostgreSQL on either queue: \
             two-phase claim, lease and reaper, idempotency key"
        }
        ("sqs", "I6") => {
            "delete only after the work committed (a stale delete then removes a message \
             already processed); a killed worker's messages come back after the visibility \
             timeout; SQS dead-letters after the maximum receives"
        }
        _ => {
            "delete only after success; stale receipts refused; a killed worker's messages \
             come back after the visibility timeout"
        }
    }
}

/// At most this many pending jobs or messages are listed in a verdict.
const LISTED: usize = 5;

/// The demo's report of an incident run: its figures, the invariants, and a
/// verdict that separates violations from work still pending at the
/// deadline: a violation fails it, pending work (a stalled drain or settle,
/// a message or notification not done yet, a failed restart) leaves it
/// unfinished.
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
            "dropped by the queue's dedup (null: the queue does not say)",
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
        ("queue", "backend", o.backend.into()),
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
            .with("kept by", kept_by(o.backend, "I1"))
            .with(
                "invariant",
                "a singleton policy never has two OPEN incidents for one entity",
            )
            .with("held", checked.i1())
            .with("violations", checked.i1_duplicate_open.len()),
        Row::new("I2")
            .with("kept by", kept_by(o.backend, "I2"))
            .with("invariant", "incident numbers are 1..n per organization")
            .with("held", checked.i2())
            .with("violations", checked.i2_number_gaps.len()),
        Row::new("I3")
            .with("kept by", kept_by(o.backend, "I3"))
            .with("invariant", "each incident is notified exactly once")
            .with(
                "held",
                o.notifications.holds() && checked.i3() && o.deliveries.holds(),
            )
            .with(
                "violations",
                o.notifications.more_than_once.len() + o.notifications.never_enqueued_or_lost.len(),
            )
            .with("pending", o.notifications.pending_at_deadline.len()),
        Row::new("I6")
            .with("kept by", kept_by(o.backend, "I6"))
            .with("invariant", "no observation lost")
            .with("held", o.observations.holds() && checked.i6())
            .with("violations", o.observations.lost.len())
            .with("pending", o.observations.pending_at_deadline.len()),
    ];
    report.sections.insert("invariants".into(), invariant_rows);
    if o.backend == "sqs" {
        report
            .sections
            .insert("where SQS is weaker".into(), sqs_gaps(o));
    }
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
        // The fault asked for, not the service: a restart that failed
        // leaves the run short of what it set out to do.
        v.finished(
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
    v.finished(
        o.drained,
        format!(
            "the pipeline drained (never {} s without progress)",
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
    // Still waiting (lease, backoff, claim) when the settle stalled: not
    // notified yet, and not lost.
    v.finished(
        n.pending_at_deadline.is_empty(),
        format!(
            "I3: {} notification jobs still pending at the deadline ({:.1} s without any of them \
             moving, from the lease, the retry schedule and the attempts){}",
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
    let d = &o.deliveries;
    v.check(
        d.holds(),
        format!(
            "I3 in the receiver's log: of {} incidents, {} accepted more than once, {} never \
             accepted though their job finished; {} notifications for no incident of the run{}",
            d.incidents,
            d.doubled.len(),
            d.missing.len(),
            d.strays.len(),
            listed(
                d.doubled
                    .iter()
                    .map(|x| format!("incident {}: keys {}", x.incident_id, x.keys.join(", ")))
                    .chain(d.missing.iter().map(|id| format!("incident {id}: none")))
            )
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
                "message {}: {}{}",
                m.message_id,
                m.queue.as_deref().unwrap_or("deleted"),
                o.produced
                    .retried_sends
                    .get(&m.message_id)
                    .map(|r| format!(
                        " (its send was retried after {}; {})",
                        r.errors.join(", then "),
                        if r.answered_as_duplicate {
                            "the last attempt was answered as a duplicate of an earlier one"
                        } else {
                            "the last attempt inserted it"
                        }
                    ))
                    .unwrap_or_default()
            )))
        ),
    );
    // Still in the queue when the drain stalled: not processed yet, and not
    // lost.
    v.finished(
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
    // A malformed message still in the queue has receives to go before it
    // is dead-lettered; one in neither queue vanished.
    v.check(
        obs.malformed_vanished() == 0,
        format!(
            "queue: {} of {} malformed messages vanished (in neither queue)",
            obs.malformed_vanished(),
            obs.malformed_sent
        ),
    );
    v.finished(
        obs.malformed_pending == 0,
        format!(
            "queue: {} of {} malformed messages in the dead-letter queue ({} there in all), \
             {} still in the queue at the deadline",
            obs.malformed_dead_lettered,
            obs.malformed_sent,
            obs.dead_lettered,
            obs.malformed_pending
        ),
    );
    report
}

/// What SQS does not do that the PostgreSQL queue does, and what this run
/// saw of each.
fn sqs_gaps(o: &IncidentRunOutcome) -> Vec<Row> {
    vec![
        Row::new("stale receipts")
            .with(
                "sqs",
                "a delete with an earlier delivery's receipt succeeds",
            )
            .with(
                "carried by",
                "the guard (I1); delete only after commit (I6)",
            )
            .with(
                "exercised",
                format!("{} redeliveries", o.pipeline.redeliveries),
            ),
        Row::new("at least once")
            .with(
                "sqs",
                "a killed worker's messages come back after the visibility timeout",
            )
            .with(
                "carried by",
                "the guard (I1); the notification job's claim and lease (I3)",
            )
            .with("exercised", "one runtime killed mid-message"),
        Row::new("5-minute dedup window")
            .with("sqs", "a resend later than 5 minutes is a new message")
            .with(
                "carried by",
                "the guard (I1); the incident's source message id (the dedupe key)",
            )
            .with(
                "exercised",
                format!(
                    "{} duplicate sends within the window",
                    o.produced.duplicate_sends
                ),
            ),
    ]
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
