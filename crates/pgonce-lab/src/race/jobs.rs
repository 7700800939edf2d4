//! `pgonce race jobs`: an SQS worker's duplicate execution (a crash
//! before the delete, a visibility timeout during the work). One job's
//! message delivered twice, concurrently, replayed step by step under four
//! guards, plus the two failure cases the two-phase guard needs a reaper for.
//!
//! The side effect stands for the remote call (an LLM call, a charge): it is
//! written on its own connection in autocommit, outside the worker's
//! transaction, so it happens whatever the worker's transaction does later,
//! just like a remote call. `side_effects` counts those rows; a transition
//! counts when its UPDATE matched the job's row.
//!
//! * `no-guard`: read, side effect, unconditional UPDATE: two transitions,
//!   two side effects.
//! * `where-status`: the single conditional UPDATE. One transition, but both
//!   deliveries ran the side effect before it (the pattern's caveat: it
//!   prevents a duplicate transition, not a duplicate side effect).
//! * `two-phase`: claim first; the loser of the claim never runs the side
//!   effect. Exactly one of each. The loser sees `JobBusy` (the job is
//!   claimed, not done) and keeps its message.
//! * `dedupe-key`: the message id is marked processed in the transaction of
//!   an effect that is a database write; the duplicate skips it.
//! * `crash`: the claimer dies; the redelivery finds the job `processing`
//!   and gets `JobBusy`, so it keeps its message; the lease expires; the
//!   reaper returns the job; that message's next delivery runs it. Nothing
//!   lost.
//! * `late-completion`: the claimer is slow, its lease expires and is taken
//!   over; its late completion is rejected (`LeaseLost`), the new owner's
//!   result stands. `late-completion-heartbeat`: the same worker heartbeats,
//!   nobody takes over, one side effect.
//!
//! Lease expiry is simulated by moving `lease_expires_at` into the past: the
//! race is about the order of events, not about waiting for a clock.

use std::fmt;
use std::time::Duration;

use pgonce::Error;
use pgonce::IsolationLevel;
use pgonce::job::{self, JobStatus, NewJob, Reaper, ReaperConfig};
use pgonce_testkit::{Interleaving, Session};
use serde_json::json;
use sqlx::PgPool;

use super::timeline_rows;
use crate::report::{Environment, Report, Row};
use crate::scratch::RunDatabase;

const LEASE: Duration = Duration::from_secs(300);

/// The guards raced against one job's duplicate delivery, and the failure
/// cases of the two-phase claim, in the order `pgonce race jobs` runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobCaseName {
    /// Read, side effect, unconditional UPDATE.
    NoGuard,
    /// The single conditional UPDATE after the side effect.
    WhereStatus,
    /// Claim first; only the claim's winner runs the side effect.
    TwoPhase,
    /// The message marked processed in the transaction of a database effect.
    DedupeKey,
    /// The claimer dies; its lease expires and the reaper returns the job.
    Crash,
    /// The claimer is slow, its lease is taken over, it completes late.
    LateCompletion,
    /// The same slow claimer, heartbeating.
    LateCompletionHeartbeat,
}

impl JobCaseName {
    /// Every case, in the order they run.
    pub const ALL: [JobCaseName; 7] = [
        JobCaseName::NoGuard,
        JobCaseName::WhereStatus,
        JobCaseName::TwoPhase,
        JobCaseName::DedupeKey,
        JobCaseName::Crash,
        JobCaseName::LateCompletion,
        JobCaseName::LateCompletionHeartbeat,
    ];

    /// The case's name in the report (`no-guard`, `two-phase`...).
    pub(crate) const fn name(self) -> &'static str {
        match self {
            JobCaseName::NoGuard => "no-guard",
            JobCaseName::WhereStatus => "where-status",
            JobCaseName::TwoPhase => "two-phase",
            JobCaseName::DedupeKey => "dedupe-key",
            JobCaseName::Crash => "crash",
            JobCaseName::LateCompletion => "late-completion",
            JobCaseName::LateCompletionHeartbeat => "late-completion-heartbeat",
        }
    }
}

/// What a delivery's call into `pgonce::job` (or the dedupe key) returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// The transition or claim applied.
    Applied,
    /// An unconditional UPDATE applied over the first delivery's result.
    Overwrote,
    /// The job was already terminal: acknowledge the message.
    AlreadyHandled,
    /// The job is in another delivery's hands: keep the message.
    JobBusy(JobStatus),
    /// The lease was reaped and taken over: nothing written.
    LeaseLost,
    /// The message id was already processed: the effect was skipped.
    SkippedDuplicateKey,
    /// Any other error, in words.
    Failed(String),
}

impl Delivery {
    fn of<T>(r: &pgonce::Result<T>) -> Delivery {
        match r {
            Ok(_) => Delivery::Applied,
            Err(Error::AlreadyHandled { .. }) => Delivery::AlreadyHandled,
            Err(Error::JobBusy { status, .. }) => Delivery::JobBusy(*status),
            Err(Error::LeaseLost { .. }) => Delivery::LeaseLost,
            Err(e) => Delivery::Failed(e.to_string()),
        }
    }
}

impl fmt::Display for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Delivery::Applied => f.write_str("applied"),
            Delivery::Overwrote => f.write_str("applied (overwrote A's result)"),
            Delivery::AlreadyHandled => f.write_str("AlreadyHandled"),
            Delivery::JobBusy(status) => write!(f, "JobBusy ({status})"),
            Delivery::LeaseLost => f.write_str("LeaseLost"),
            Delivery::SkippedDuplicateKey => f.write_str("skipped (duplicate key)"),
            Delivery::Failed(e) => write!(f, "error: {e}"),
        }
    }
}

/// What one case's interleaving produced.
#[derive(Debug, Clone)]
pub struct JobCase {
    /// Which interleaving this was.
    pub name: JobCaseName,
    /// Transitions whose UPDATE matched the job's row.
    pub transitions: u32,
    /// Side effects recorded (the remote call's stand-in).
    pub side_effects: i64,
    /// What the second delivery (or the late or redelivered one) got.
    pub second: Delivery,
    /// The job's status at the end.
    pub final_status: String,
    /// The job's stored result at the end.
    pub final_result: Option<serde_json::Value>,
    /// Jobs the reaper returned to pending, where the case runs it.
    pub reaped: Option<u64>,
    /// `crash`: what the redelivery got while the dead claimer held the job.
    pub redelivery_while_stuck: Option<Delivery>,
    pub(crate) timeline: Vec<pgonce_testkit::Step>,
}

impl JobCase {
    /// I3: one transition and one side effect, or, for the failure cases,
    /// the job completed by the delivery that still held it.
    pub fn invariant_held(&self) -> bool {
        match self.name {
            JobCaseName::NoGuard | JobCaseName::WhereStatus | JobCaseName::DedupeKey => {
                self.transitions == 1 && self.side_effects == 1
            }
            JobCaseName::TwoPhase => {
                self.transitions == 1
                    && self.side_effects == 1
                    && self.second == Delivery::JobBusy(JobStatus::Processing)
            }
            JobCaseName::Crash => {
                self.final_status == "completed"
                    && self.side_effects == 1
                    && self.redelivery_while_stuck == Some(Delivery::JobBusy(JobStatus::Processing))
            }
            JobCaseName::LateCompletion => {
                self.final_status == "completed" && self.second == Delivery::LeaseLost
            }
            JobCaseName::LateCompletionHeartbeat => {
                self.final_status == "completed" && self.side_effects == 1
            }
        }
    }

    /// Whether the case showed what it is there to show: the guards hold,
    /// `no-guard` and `where-status` break in their known way.
    pub fn as_expected(&self) -> bool {
        match self.name {
            JobCaseName::NoGuard => self.transitions == 2 && self.side_effects == 2,
            JobCaseName::WhereStatus => self.transitions == 1 && self.side_effects == 2,
            _ => self.invariant_held(),
        }
    }

    fn reason(&self) -> &'static str {
        match self.name {
            JobCaseName::NoGuard => {
                "no-guard: both deliveries transition and run the side effect (shown, as expected)"
            }
            JobCaseName::WhereStatus => {
                "where-status: one transition, but the side effect ran twice (it guards the transition, not the side effect; shown)"
            }
            JobCaseName::TwoPhase => {
                "two-phase: exactly one transition and exactly one side effect; the loser sees JobBusy and keeps its message"
            }
            JobCaseName::DedupeKey => "dedupe-key: the duplicate skips the effect: exactly one",
            JobCaseName::Crash => {
                "crash: the redelivery seeing JobBusy kept its message; after the reaper returned the dead claimer's job, that message completed it"
            }
            JobCaseName::LateCompletion => {
                "late-completion: the worker whose lease was taken over cannot overwrite the new owner's result"
            }
            JobCaseName::LateCompletionHeartbeat => {
                "late-completion-heartbeat: a heartbeat keeps the slow worker's lease: one side effect"
            }
        }
    }

    fn row(&self) -> Row {
        let mut row = Row::new(self.name.name())
            .with("transitions_applied", self.transitions)
            .with("side_effects", self.side_effects)
            .with("second_delivery", self.second.to_string())
            .with("final_status", &self.final_status)
            .with("invariant_held", self.invariant_held());
        if let Some(reaped) = self.reaped {
            row.set("reaped", json!(reaped));
        }
        if let Some(stuck) = &self.redelivery_while_stuck {
            row.set("redelivery_while_stuck", json!(stuck.to_string()));
        }
        if matches!(
            self.name,
            JobCaseName::NoGuard
                | JobCaseName::LateCompletion
                | JobCaseName::LateCompletionHeartbeat
        ) {
            row.set("result", json!(self.final_result));
        }
        row
    }
}

/// Everything `pgonce race jobs` replays.
#[derive(Debug, Clone)]
pub struct JobsRace {
    /// Every case replayed; [`JobsRace::case`] finds one.
    pub cases: Vec<JobCase>,
}

impl JobsRace {
    /// The case `name`.
    pub fn case(&self, name: JobCaseName) -> &JobCase {
        self.cases
            .iter()
            .find(|c| c.name == name)
            .expect("every case is replayed")
    }
}

pub(crate) async fn run(db: &RunDatabase) -> anyhow::Result<Report> {
    let race = replay(db).await?;
    Ok(report(&race, db.environment().await?))
}

/// Replays every case, each on a job of its own.
pub async fn replay(db: &RunDatabase) -> anyhow::Result<JobsRace> {
    sqlx::raw_sql(include_str!("sql/jobs_schema.sql"))
        .execute(db.pool())
        .await?;
    let mut cases = Vec::new();
    for name in JobCaseName::ALL {
        let race = Interleaving::new(db.options()).await?;
        let outcome = match name {
            JobCaseName::NoGuard => no_guard(db, &race).await?,
            JobCaseName::WhereStatus => where_status(db, &race).await?,
            JobCaseName::TwoPhase => two_phase(db, &race).await?,
            JobCaseName::DedupeKey => dedupe_key(db, &race).await?,
            JobCaseName::Crash => crash(db, &race).await?,
            JobCaseName::LateCompletion => late_completion(db, &race, false).await?,
            JobCaseName::LateCompletionHeartbeat => late_completion(db, &race, true).await?,
        };
        cases.push(JobCase {
            name,
            transitions: outcome.transitions,
            side_effects: side_effects(db.pool(), outcome.job).await?,
            second: outcome.second,
            final_status: final_status(db.pool(), outcome.job).await?,
            final_result: job::get(db.pool(), outcome.job)
                .await?
                .and_then(|r| r.result)
                .transpose()?,
            reaped: outcome.reaped,
            redelivery_while_stuck: outcome.redelivery_while_stuck,
            timeline: race.timeline(),
        });
    }
    Ok(JobsRace { cases })
}

pub(crate) fn report(race: &JobsRace, environment: Environment) -> Report {
    let mut report = Report::new("race", "jobs", environment);
    for case in &race.cases {
        report.results.push(case.row());
        report.sections.insert(
            format!("timeline: {}", case.name.name()),
            timeline_rows(case.name.name(), &case.timeline),
        );
        report.verdict.check(case.as_expected(), case.reason());
    }
    report
}

/// What one interleaving reports back; [`replay`] reads the rest from the
/// database.
struct Outcome {
    job: i64,
    transitions: u32,
    second: Delivery,
    reaped: Option<u64>,
    redelivery_while_stuck: Option<Delivery>,
}

async fn new_job(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(job::enqueue(pool, &NewJob::new("summarise", json!({"doc": 7}))).await?)
}

/// The remote call: recorded on its own connection, committed at once.
async fn side_effect(pool: &PgPool, id: i64, by: &str) -> anyhow::Result<()> {
    sqlx::query("INSERT INTO race_jobs_side_effects (job_id, by_session) VALUES ($1, $2)")
        .bind(id)
        .bind(by)
        .execute(pool)
        .await?;
    Ok(())
}

async fn side_effects(pool: &PgPool, id: i64) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM race_jobs_side_effects WHERE job_id = $1")
            .bind(id)
            .fetch_one(pool)
            .await?,
    )
}

async fn final_status(pool: &PgPool, id: i64) -> anyhow::Result<String> {
    Ok(job::get(pool, id)
        .await?
        .map(|r| r.status)
        .unwrap_or_default())
}

async fn read_status(s: &Session, id: i64) -> anyhow::Result<String> {
    Ok(
        sqlx::query_scalar("SELECT status FROM pgonce.jobs WHERE id = $1")
            .bind(id)
            .fetch_one(s.pool())
            .await?,
    )
}

async fn sessions(race: &Interleaving) -> anyhow::Result<(Session, Session)> {
    Ok((race.session("A").await?, race.session("B").await?))
}

async fn no_guard(db: &RunDatabase, race: &Interleaving) -> anyhow::Result<Outcome> {
    let pool = db.pool();
    let id = new_job(pool).await?;
    let (a, b) = sessions(race).await?;
    let sa = race
        .step(&a, "read job: pending", read_status(&a, id))
        .await??;
    let sb = race
        .step(&b, "read job: pending", read_status(&b, id))
        .await??;
    anyhow::ensure!(sa == "pending" && sb == "pending");
    race.step(&a, "side effect", side_effect(pool, id, "A"))
        .await??;
    race.step(&b, "side effect", side_effect(pool, id, "B"))
        .await??;
    let mut transitions = 0;
    for (s, by) in [(&a, "A"), (&b, "B")] {
        let done = race
            .step(
                s,
                "UPDATE jobs SET status = 'completed' WHERE id = $1",
                sqlx::query(
                    "UPDATE pgonce.jobs SET status = 'completed', result = $2, finished_at = now() WHERE id = $1",
                )
                .bind(id)
                .bind(json!({"by": by}))
                .execute(s.pool()),
            )
            .await??;
        transitions += done.rows_affected() as u32;
    }
    Ok(Outcome {
        job: id,
        transitions,
        second: Delivery::Overwrote,
        reaped: None,
        redelivery_while_stuck: None,
    })
}

async fn where_status(db: &RunDatabase, race: &Interleaving) -> anyhow::Result<Outcome> {
    let pool = db.pool();
    let id = new_job(pool).await?;
    let (a, b) = sessions(race).await?;
    race.step(&a, "read job: pending", read_status(&a, id))
        .await??;
    race.step(&b, "read job: pending", read_status(&b, id))
        .await??;
    race.step(&a, "side effect", side_effect(pool, id, "A"))
        .await??;
    race.step(&b, "side effect", side_effect(pool, id, "B"))
        .await??;
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted).await?;
    let first = race
        .step(
            &a,
            "UPDATE ... WHERE status = 'pending'",
            job::transition(
                &mut *tx_a,
                id,
                JobStatus::Pending,
                JobStatus::Completed,
                Some(&json!({"by": "A"})),
                None,
            ),
        )
        .await?;
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "UPDATE ... WHERE status = 'pending'", async move {
            job::transition(
                &pool_b,
                id,
                JobStatus::Pending,
                JobStatus::Completed,
                Some(&json!({"by": "B"})),
                None,
            )
            .await
        })
        .await?;
    race.step(&a, "COMMIT", tx_a.commit()).await??;
    let second = waiting.resume().await?;
    race.note(&b, &format!("0 rows: {}", Delivery::of(&second)));
    Ok(Outcome {
        job: id,
        transitions: first.is_ok() as u32 + second.is_ok() as u32,
        second: Delivery::of(&second),
        reaped: None,
        redelivery_while_stuck: None,
    })
}

async fn two_phase(db: &RunDatabase, race: &Interleaving) -> anyhow::Result<Outcome> {
    let pool = db.pool();
    let id = new_job(pool).await?;
    let (a, b) = sessions(race).await?;
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted).await?;
    let lease = race
        .step(
            &a,
            "claim: pending -> processing",
            job::claim(&mut *tx_a, id, LEASE),
        )
        .await??;
    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "claim: pending -> processing", async move {
            job::claim(&pool_b, id, LEASE).await
        })
        .await?;
    race.step(&a, "COMMIT", tx_a.commit()).await??;
    let second = waiting.resume().await?;
    let mut transitions = 0;
    if second.is_ok() {
        race.step(&b, "side effect", side_effect(pool, id, "B"))
            .await??;
    } else {
        race.note(
            &b,
            &format!(
                "claim lost ({}): skips the side effect, keeps its message",
                Delivery::of(&second)
            ),
        );
    }
    race.step(&a, "side effect", side_effect(pool, id, "A"))
        .await??;
    let done = race
        .step(
            &a,
            "complete (fenced by lease)",
            job::complete(a.pool(), &lease, &json!({"by": "A"})),
        )
        .await?;
    transitions += done.is_ok() as u32;
    Ok(Outcome {
        job: id,
        transitions,
        second: Delivery::of(&second),
        reaped: None,
        redelivery_while_stuck: None,
    })
}

async fn dedupe_key(db: &RunDatabase, race: &Interleaving) -> anyhow::Result<Outcome> {
    let pool = db.pool();
    let id = new_job(pool).await?;
    let message_id = format!("msg-{id}");
    let (a, b) = sessions(race).await?;
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted).await?;
    let first = race
        .step(
            &a,
            "mark message processed",
            pgonce::dedupe::mark_processed(&mut tx_a, "race-jobs", &message_id),
        )
        .await??;
    anyhow::ensure!(first, "A is the first delivery");
    // The effect is a database write in the same transaction as the mark.
    race.step(
        &a,
        "side effect (same transaction)",
        sqlx::query("INSERT INTO race_jobs_side_effects (job_id, by_session) VALUES ($1, 'A')")
            .bind(id)
            .execute(&mut *tx_a),
    )
    .await??;
    let t_a = race
        .step(
            &a,
            "pending -> completed",
            job::transition(
                &mut *tx_a,
                id,
                JobStatus::Pending,
                JobStatus::Completed,
                None,
                None,
            ),
        )
        .await?;
    let pool_b = b.pool().clone();
    let msg = message_id.clone();
    let waiting = race
        .step_blocks(&b, "mark message processed", async move {
            let mut tx = pgonce::begin(&pool_b, IsolationLevel::ReadCommitted).await?;
            let first = pgonce::dedupe::mark_processed(&mut tx, "race-jobs", &msg).await?;
            let mut transitioned = false;
            if first {
                sqlx::query(
                    "INSERT INTO race_jobs_side_effects (job_id, by_session) VALUES ($1, 'B')",
                )
                .bind(id)
                .execute(&mut *tx)
                .await?;
                transitioned = job::transition(
                    &mut *tx,
                    id,
                    JobStatus::Pending,
                    JobStatus::Completed,
                    None,
                    None,
                )
                .await
                .is_ok();
            }
            tx.commit().await?;
            Ok::<(bool, bool), Error>((first, transitioned))
        })
        .await?;
    race.step(&a, "COMMIT", tx_a.commit()).await??;
    let (b_first, b_transitioned) = waiting.resume().await??;
    race.note(
        &b,
        if b_first {
            "key was new: applied"
        } else {
            "key already processed: skipped"
        },
    );
    Ok(Outcome {
        job: id,
        transitions: t_a.is_ok() as u32 + b_transitioned as u32,
        second: if b_first {
            Delivery::Applied
        } else {
            Delivery::SkippedDuplicateKey
        },
        reaped: None,
        redelivery_while_stuck: None,
    })
}

async fn expire_lease(pool: &PgPool, id: i64) -> anyhow::Result<()> {
    sqlx::query(
        "UPDATE pgonce.jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(id)
    .execute(pool)
    .await?;
    Ok(())
}

async fn crash(db: &RunDatabase, race: &Interleaving) -> anyhow::Result<Outcome> {
    let pool = db.pool();
    let id = new_job(pool).await?;
    let (a, b) = sessions(race).await?;
    let _lost = race
        .step(
            &a,
            "claim: pending -> processing",
            job::claim(a.pool(), id, LEASE),
        )
        .await??;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(a.pool())
        .await?;
    race.step(
        &a,
        "dies (pg_terminate_backend)",
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(pool),
    )
    .await??;
    let stuck = race
        .step(&b, "redelivery: claim", job::claim(b.pool(), id, LEASE))
        .await?;
    anyhow::ensure!(
        matches!(stuck, Err(Error::JobBusy { .. })),
        "a redelivery facing a claimed job must not be told to acknowledge: {}",
        Delivery::of(&stuck)
    );
    race.note(
        &b,
        &format!(
            "job stuck in processing: {}: message not acknowledged, it comes back",
            Delivery::of(&stuck)
        ),
    );
    race.step(&b, "lease expires", expire_lease(pool, id))
        .await??;
    let reaper = Reaper::new(pool.clone(), ReaperConfig::default())?;
    let reaped = race
        .step(&b, "reaper.run_once()", reaper.run_once())
        .await??;
    race.note(
        &b,
        &format!("reaper returned {} job(s) to pending", reaped.returned),
    );
    let lease = race
        .step(&b, "redelivery: claim", job::claim(b.pool(), id, LEASE))
        .await??;
    race.step(&b, "side effect", side_effect(pool, id, "B"))
        .await??;
    let done = race
        .step(
            &b,
            "complete",
            job::complete(b.pool(), &lease, &json!({"by": "B"})),
        )
        .await?;
    Ok(Outcome {
        job: id,
        transitions: done.is_ok() as u32,
        second: Delivery::of(&done),
        reaped: Some(reaped.returned),
        redelivery_while_stuck: Some(Delivery::of(&stuck)),
    })
}

async fn late_completion(
    db: &RunDatabase,
    race: &Interleaving,
    heartbeat: bool,
) -> anyhow::Result<Outcome> {
    let pool = db.pool();
    let id = new_job(pool).await?;
    let (a, b) = sessions(race).await?;
    let mut lease_a = race
        .step(&a, "claim", job::claim(a.pool(), id, LEASE))
        .await??;
    race.step(&a, "side effect (slow)", side_effect(pool, id, "A"))
        .await??;
    if heartbeat {
        lease_a = race
            .step(&a, "heartbeat", job::heartbeat(a.pool(), &lease_a, LEASE))
            .await??;
    } else {
        race.step(&a, "lease expires while A works", expire_lease(pool, id))
            .await??;
    }
    let reaper = Reaper::new(pool.clone(), ReaperConfig::default())?;
    let reaped = race
        .step(&b, "reaper.run_once()", reaper.run_once())
        .await??;
    let b_claim = race
        .step(&b, "redelivery: claim", job::claim(b.pool(), id, LEASE))
        .await?;
    let mut transitions = 0;
    if let Ok(lease_b) = &b_claim {
        race.step(&b, "side effect", side_effect(pool, id, "B"))
            .await??;
        let done = race
            .step(
                &b,
                "complete",
                job::complete(b.pool(), lease_b, &json!({"by": "B"})),
            )
            .await?;
        transitions += done.is_ok() as u32;
    } else {
        race.note(&b, &format!("claim: {}", Delivery::of(&b_claim)));
    }
    let late = race
        .step(
            &a,
            "late complete with its old lease",
            job::complete(a.pool(), &lease_a, &json!({"by": "A"})),
        )
        .await?;
    race.note(&a, &Delivery::of(&late).to_string());
    transitions += late.is_ok() as u32;
    Ok(Outcome {
        job: id,
        transitions,
        second: Delivery::of(&late),
        reaped: Some(reaped.returned),
        redelivery_while_stuck: None,
    })
}
