//! A reference model of the job state machine, checked step by step
//! against PostgreSQL.
//!
//! Random sequences of enqueues, claims (one at a time, in batches, two
//! deliveries racing on one row, a takeover of a lease that ran out, a
//! claim making dead a job whose lease ran out on its last attempt, and a
//! claim rolled back whose lease is presented under a snapshot taken while
//! it was open), heartbeats (one racing a claim of its job, held in an
//! open transaction), completions (one and many), a holder's heartbeat,
//! completion or failure held open while a reaper pass runs,
//! failures with their retry schedule, lease expiry and the reaper, the
//! re-driver, an operator's retry of dead jobs, conditional transitions and
//! maintenance run against both an in-memory model of the contract and the
//! database. After every step the outcome (lease, `JobBusy` and its status,
//! `AlreadyHandled`, `LeaseLost`, what a pass reaped, re-drove or deleted)
//! and every row must be what the model says. Each completion records its
//! side effect in the transaction that completes the job, so "a side effect
//! is recorded at most once" is checked on committed rows. A case ends by
//! letting time pass and running the reaper, the re-driver and a worker
//! until nothing is left to do: every job must then be terminal (none
//! stranded) and each completed job's effect recorded exactly once.
//!
//! Time is moved, never waited for: a lease runs out, a retry comes due or
//! a finished job ages past its retention by an `UPDATE` that sets the
//! row's timestamp into the past, so no verdict depends on the machine's
//! speed.
//!
//! `MODEL_TEST_CASES` sets the number of cases (default 16); see
//! docs/testing.md.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use pgonce::job::{
    self, FailOutcome, JobStatus, Lease, NewJob, Reaper, ReaperConfig, Redriver, RedriverConfig,
    RetryBy, RetryPolicy,
};
use pgonce::maintenance::{self, MaintenanceConfig};
use pgonce::{Error, IsolationLevel};
use pgonce_testkit::{Interleaving, Session, fresh_database};
use proptest::prelude::*;
use serde_json::{Value, json};
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

/// Leases long enough that only the model's `Expire` ends one.
const LEASE: Duration = Duration::from_secs(3600);
const KIND: &str = "model";

/// A retry an hour away: only the model's `MakeDue` brings it closer.
fn policy() -> RetryPolicy {
    RetryPolicy {
        base: Duration::from_secs(3600),
        max: Duration::from_secs(7200),
        jitter: 0.0,
    }
}

/// Maintenance of jobs only, at the default retentions (completed: 24 h,
/// dead: 7 days). `Age` sets a finished job 30 days back.
fn maintenance_config() -> MaintenanceConfig {
    MaintenanceConfig {
        queue_dedup: None,
        dead_letter_messages: None,
        idempotency_keys: None,
        processed_messages: None,
        ..MaintenanceConfig::default()
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A job allowing `max_attempts` failed attempts, due now or in a day.
    Enqueue {
        max_attempts: i32,
        later: bool,
    },
    Claim(usize),
    ClaimBatch(i64),
    /// Leases are counted from the newest issued, stale ones included.
    Heartbeat(usize),
    Complete(usize),
    CompleteMany(Vec<usize>),
    Fail(usize),
    /// The conditional transition from pending (`false`) or failed
    /// (`true`) to completed (`false`) or dead (`true`).
    Transition(usize, bool, bool),
    /// The job's lease runs out.
    Expire(usize),
    /// The job's `run_at` passes (a delayed job, a retry's backoff).
    MakeDue(usize),
    Reap,
    Redrive,
    RetryDead(usize),
    /// The finished job ages past every retention.
    Age(usize),
    Maintenance,
    /// Two deliveries claim the job at once: A's claim holds the row in an
    /// open transaction, B's claim is seen waiting for A, then A commits
    /// (`true`) or rolls back.
    ClaimRace(usize, bool),
    /// A claim in a transaction that rolls back (a takeover of a lease that
    /// ran out undone with it); its lease is presented in a REPEATABLE
    /// READ transaction whose snapshot was taken while the claim was open.
    ClaimRolledBack(usize),
    /// The holder of a lease heartbeats in A's open transaction while a
    /// delivery of its job's message claims the job (B); A commits
    /// (`true`) or rolls back.
    HeartbeatRace(usize, bool),
    /// The holder of a lease writes (a heartbeat, its completion or its
    /// failure, by `HolderWrite`) in A's open transaction while a reaper
    /// pass runs (B); A commits (`true`) or rolls back.
    ReapRace(usize, HolderWrite, bool),
}

/// What a lease's holder writes under it.
#[derive(Debug, Clone, Copy)]
enum HolderWrite {
    Heartbeat,
    Complete,
    Fail,
}

/// Weighted so that the long paths (claim, fail, come due, re-drive, claim,
/// expire, reap to dead, operator retry, age, delete) come up in few cases.
fn op() -> impl Strategy<Value = Op> {
    let j = || 0..6usize;
    let l = || prop_oneof![3 => 0..2usize, 1 => 0..16usize];
    prop_oneof![
        2 => (1..=3i32, proptest::bool::weighted(0.2))
            .prop_map(|(max_attempts, later)| Op::Enqueue { max_attempts, later }),
        5 => j().prop_map(Op::Claim),
        2 => (1..=3i64).prop_map(Op::ClaimBatch),
        2 => l().prop_map(Op::Heartbeat),
        4 => l().prop_map(Op::Complete),
        1 => proptest::collection::vec(l(), 1..4).prop_map(Op::CompleteMany),
        4 => l().prop_map(Op::Fail),
        1 => (j(), any::<bool>(), any::<bool>()).prop_map(|(j, f, d)| Op::Transition(j, f, d)),
        3 => j().prop_map(Op::Expire),
        3 => j().prop_map(Op::MakeDue),
        3 => Just(Op::Reap),
        2 => Just(Op::Redrive),
        2 => j().prop_map(Op::RetryDead),
        2 => j().prop_map(Op::Age),
        2 => Just(Op::Maintenance),
        2 => (j(), any::<bool>()).prop_map(|(j, c)| Op::ClaimRace(j, c)),
        2 => j().prop_map(Op::ClaimRolledBack),
        2 => (l(), any::<bool>()).prop_map(|(l, c)| Op::HeartbeatRace(l, c)),
        2 => (
            l(),
            prop_oneof![
                Just(HolderWrite::Heartbeat),
                Just(HolderWrite::Complete),
                Just(HolderWrite::Fail)
            ],
            any::<bool>()
        )
            .prop_map(|(l, w, c)| Op::ReapRace(l, w, c)),
    ]
}

/// A job as the contract says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Job {
    status: JobStatus,
    attempts: i32,
    max_attempts: i32,
    /// The current lease (an index into `Model::leases`), while processing.
    lease: Option<usize>,
    /// Processing: the lease ran out.
    expired: bool,
    /// Pending or failed: `run_at` has passed.
    due: bool,
    /// Completed: the result its completer stored.
    result: Option<Value>,
    /// Terminal, and finished longer ago than every retention.
    aged: bool,
}

impl Job {
    /// What `claim_batch` takes: a due pending job.
    fn claimable(&self) -> bool {
        self.status == JobStatus::Pending && self.due
    }

    /// What a single `claim` takes: a due pending job, or a failed one
    /// whose retry has come due, without waiting for the re-driver, or a
    /// processing one whose lease ran out before its last attempt, without
    /// waiting for the reaper.
    fn claimable_by_its_message(&self) -> bool {
        (matches!(self.status, JobStatus::Pending | JobStatus::Failed) && self.due)
            || (self.status == JobStatus::Processing
                && self.expired
                && self.attempts + 1 < self.max_attempts)
    }

    /// Processing, and the lease ran out on the last attempt: a claim
    /// makes the job dead, as the reaper would, and answers
    /// `AlreadyHandled`.
    fn expired_on_its_last_attempt(&self) -> bool {
        self.status == JobStatus::Processing
            && self.expired
            && self.attempts + 1 >= self.max_attempts
    }

    /// Enters a terminal state now.
    fn finish(&mut self, status: JobStatus) {
        self.status = status;
        self.lease = None;
        self.expired = false;
        self.aged = false;
    }

    /// A failed attempt (an error, or an expired lease): dead at
    /// `max_attempts`, else `otherwise`.
    fn attempt_failed(&mut self, otherwise: JobStatus, due: bool) {
        self.attempts += 1;
        if self.attempts >= self.max_attempts {
            self.finish(JobStatus::Dead);
        } else {
            self.status = otherwise;
            self.lease = None;
            self.expired = false;
            self.due = due;
        }
    }

    /// `JobBusy`'s `not_before`, when the message may come back: the
    /// lease's expiry or the retry's `run_at`. Both are an hour or more
    /// away until the model moves them into the past.
    fn check_not_before(&self, not_before: OffsetDateTime) -> Result<(), String> {
        let passed = match self.status {
            JobStatus::Processing => self.expired,
            _ => self.due,
        };
        let ahead = not_before - OffsetDateTime::now_utc() > time::Duration::MINUTE;
        if passed == ahead {
            return Err(format!(
                "JobBusy for a {} job (time passed: {passed}) not before {not_before}",
                self.status
            ));
        }
        Ok(())
    }

    /// What the comparison looks at: `due` only where a state reads it,
    /// `aged` only for terminal states.
    fn view(&self, leases: &[Lease]) -> View {
        let waiting = matches!(self.status, JobStatus::Pending | JobStatus::Failed);
        View {
            status: self.status,
            attempts: self.attempts,
            lease: self.lease.map(|l| leases[l].token),
            expired: self.status == JobStatus::Processing && self.expired,
            due: waiting && self.due,
            result: self.result.clone(),
            aged: self.status.is_terminal() && self.aged,
        }
    }
}

/// A job as compared: the model's and the row's must be equal.
#[derive(Debug, Clone, PartialEq, Eq)]
struct View {
    status: JobStatus,
    attempts: i32,
    lease: Option<Uuid>,
    expired: bool,
    due: bool,
    result: Option<Value>,
    aged: bool,
}

#[derive(Debug, sqlx::FromRow)]
struct Row {
    id: i64,
    status: String,
    attempts: i32,
    lease_token: Option<Uuid>,
    expired: bool,
    due: bool,
    result: Option<Value>,
    aged: bool,
}

impl Row {
    fn view(&self) -> Result<View, String> {
        let status = JobStatus::parse(&self.status).map_err(|e| e.to_string())?;
        let waiting = matches!(status, JobStatus::Pending | JobStatus::Failed);
        Ok(View {
            status,
            attempts: self.attempts,
            lease: self.lease_token,
            expired: status == JobStatus::Processing && self.expired,
            due: waiting && self.due,
            result: self.result.clone(),
            aged: status.is_terminal() && self.aged,
        })
    }
}

#[derive(Debug, Default)]
struct Model {
    /// By job index; `None` once maintenance deleted the row.
    jobs: Vec<Option<Job>>,
    ids: Vec<i64>,
    /// Every lease issued, oldest first, with its job's index.
    leases: Vec<Lease>,
    lease_job: Vec<usize>,
    /// Side effects recorded, by job index.
    effects: Vec<u32>,
}

impl Model {
    fn job(&self, j: usize) -> Option<usize> {
        (!self.ids.is_empty()).then(|| j % self.ids.len())
    }

    fn lease(&self, from_newest: usize) -> Option<usize> {
        let n = self.leases.len();
        (n > 0).then(|| n - 1 - from_newest % n)
    }

    /// The lease is the job's current one.
    fn current(&self, l: usize) -> bool {
        self.jobs[self.lease_job[l]]
            .as_ref()
            .is_some_and(|j| j.status == JobStatus::Processing && j.lease == Some(l))
    }

    fn issue(&mut self, j: usize, lease: Lease) -> Result<(), String> {
        if lease.job_id != self.ids[j] {
            return Err(format!("lease for {} issued for job {j}", lease.job_id));
        }
        let job = self.jobs[j].as_mut().ok_or("a deleted job was claimed")?;
        // A lease that ran out, taken over: its attempt counted, as reaped.
        if job.status == JobStatus::Processing {
            job.attempts += 1;
        }
        job.status = JobStatus::Processing;
        job.lease = Some(self.leases.len());
        job.expired = false;
        self.remember(j, lease);
        Ok(())
    }

    /// 1 when a claim of job `j` takes over a lease that ran out.
    fn taken_over(&self, j: usize) -> u64 {
        self.jobs[j]
            .as_ref()
            .is_some_and(|job| job.status == JobStatus::Processing)
            .into()
    }

    /// Completion under current lease `l`: its token is the result, and
    /// the side effect is recorded.
    fn complete(&mut self, l: usize) {
        let j = self.lease_job[l];
        let job = self.jobs[j].as_mut().unwrap();
        job.finish(JobStatus::Completed);
        job.result = Some(json!(self.leases[l].token));
        self.effects[j] += 1;
    }

    /// A reaper pass: every expired lease but job `skip`'s (its row held
    /// by another transaction) returned, or dead on its last attempt.
    /// Returns how many were returned and how many went dead.
    fn reap(&mut self, skip: Option<usize>) -> (u64, u64) {
        let (mut returned, mut dead) = (0, 0);
        for (j, job) in self.jobs.iter_mut().enumerate() {
            let Some(job) = job.as_mut() else { continue };
            if Some(j) != skip && job.status == JobStatus::Processing && job.expired {
                job.attempt_failed(JobStatus::Pending, true);
                if job.status == JobStatus::Dead {
                    dead += 1;
                } else {
                    returned += 1;
                }
            }
        }
        (returned, dead)
    }

    /// Keeps a lease of job `j` to present later, current or not.
    fn remember(&mut self, j: usize, lease: Lease) {
        self.leases.push(lease);
        self.lease_job.push(j);
    }

    /// A claim of job `j` writes the job dead (its last attempt's lease
    /// ran out), holding its row as a takeover does.
    fn claim_kills(&self, j: usize) -> bool {
        self.jobs[j]
            .as_ref()
            .is_some_and(Job::expired_on_its_last_attempt)
    }

    /// A claim made job `j` dead: its expired attempt counted.
    fn claim_killed(&mut self, j: usize, tally: &mut Tally) {
        self.jobs[j]
            .as_mut()
            .unwrap()
            .attempt_failed(JobStatus::Pending, true);
        tally.dead += 1;
        tally.claimed_dead += 1;
    }

    /// What a single claim of job `j` must return.
    fn claim_outcome(&self, j: usize) -> &'static str {
        match &self.jobs[j] {
            Some(job) if job.claimable_by_its_message() => "lease",
            Some(job) if job.expired_on_its_last_attempt() => "already handled",
            Some(job) if !job.status.is_terminal() => job.status.as_str(),
            _ => "already handled",
        }
    }
}

/// A claim's outcome as the model names it: a lease, `JobBusy` with its
/// status, or `AlreadyHandled`.
fn claim_seen(r: &pgonce::Result<Lease>) -> String {
    match r {
        Ok(_) => "lease".into(),
        Err(Error::JobBusy { status, .. }) => status.as_str().into(),
        Err(Error::AlreadyHandled { .. }) => "already handled".into(),
        Err(e) => format!("error: {e}"),
    }
}

/// How often the paths under test came up, to show a run reached them.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    claimed: u64,
    busy: u64,
    handled: u64,
    raced: u64,
    /// Heartbeats a takeover waited for.
    beats_raced: u64,
    /// Holders' writes a reaper pass passed by.
    reaps_raced: u64,
    taken_over: u64,
    /// Claims that met a lease run out on its job's last attempt and made
    /// the job dead.
    claimed_dead: u64,
    rolled_back: u64,
    completed: u64,
    lease_lost: u64,
    failed: u64,
    reaped: u64,
    dead: u64,
    redriven: u64,
    retried: u64,
    deleted: u64,
}

struct Harness<'a> {
    pool: &'a PgPool,
    race: &'a Interleaving,
    sessions: &'a [Session; 2],
}

impl Harness<'_> {
    /// Completes under `lease` and records the side effect in the same
    /// transaction; commits only if the completion took.
    async fn complete(&self, lease: &Lease) -> pgonce::Result<()> {
        let mut tx = pgonce::begin(self.pool, IsolationLevel::ReadCommitted).await?;
        record_effect(&mut tx, lease.job_id).await?;
        match job::complete(&mut *tx, lease, &json!(lease.token)).await {
            Ok(()) => Ok(tx.commit().await?),
            Err(e) => {
                tx.rollback().await?;
                Err(e)
            }
        }
    }

    async fn step(&self, m: &mut Model, op: &Op, tally: &mut Tally) -> Result<(), String> {
        let pool = self.pool;
        let db = |e: pgonce::Error| format!("unexpected error: {e}");
        let sql = |e: sqlx::Error| format!("unexpected error: {e}");
        match *op {
            Op::Enqueue {
                max_attempts,
                later,
            } => {
                let mut new = NewJob::new(KIND, json!(m.ids.len())).max_attempts(max_attempts);
                if later {
                    new.run_at = Some(OffsetDateTime::now_utc() + time::Duration::DAY);
                }
                m.ids.push(job::enqueue(pool, &new).await.map_err(db)?);
                m.effects.push(0);
                m.jobs.push(Some(Job {
                    status: JobStatus::Pending,
                    attempts: 0,
                    max_attempts,
                    lease: None,
                    expired: false,
                    due: !later,
                    result: None,
                    aged: false,
                }));
            }
            Op::Claim(j) => {
                let Some(j) = m.job(j) else { return Ok(()) };
                let want = m.claim_outcome(j);
                let kills = m.claim_kills(j);
                let got = job::claim(pool, m.ids[j], LEASE).await;
                let seen = claim_seen(&got);
                if seen != want {
                    return Err(format!("claim: {seen}, model: {want}"));
                }
                if kills {
                    m.claim_killed(j, tally);
                }
                match got {
                    Ok(lease) => {
                        tally.claimed += 1;
                        tally.taken_over += m.taken_over(j);
                        m.issue(j, lease)?;
                    }
                    Err(Error::JobBusy { not_before, .. }) => {
                        tally.busy += 1;
                        m.jobs[j].as_ref().unwrap().check_not_before(not_before)?;
                    }
                    Err(_) => tally.handled += 1,
                }
            }
            Op::ClaimBatch(limit) => {
                let runnable: BTreeSet<i64> = (0..m.ids.len())
                    .filter(|&j| m.jobs[j].as_ref().is_some_and(Job::claimable))
                    .map(|j| m.ids[j])
                    .collect();
                let got = job::claim_batch(pool, KIND, limit, LEASE)
                    .await
                    .map_err(db)?;
                let ids: BTreeSet<i64> = got.iter().map(|c| c.lease.job_id).collect();
                // Which runnable jobs a short batch takes is the queue's
                // order (run_at, id), not the contract: any of them will do,
                // each once, as many as the limit allows.
                let want = runnable.len().min(limit as usize);
                if ids.len() != got.len() || ids.len() != want || !ids.is_subset(&runnable) {
                    return Err(format!(
                        "claim_batch({limit}) took {ids:?}, model: {want} of {runnable:?}"
                    ));
                }
                for c in got {
                    let j = m.ids.iter().position(|&id| id == c.lease.job_id).unwrap();
                    let attempts = m.jobs[j].as_ref().unwrap().attempts;
                    if c.attempts != attempts {
                        return Err(format!("claimed job {j} with {} attempts", c.attempts));
                    }
                    tally.claimed += 1;
                    m.issue(j, c.lease)?;
                }
            }
            Op::Heartbeat(l) => {
                let Some(l) = m.lease(l) else { return Ok(()) };
                let want = m.current(l);
                let got = job::heartbeat(pool, &m.leases[l], LEASE).await;
                match (got, want) {
                    (Ok(renewed), true) => {
                        if renewed.token != m.leases[l].token {
                            return Err("a heartbeat changed the token".into());
                        }
                        m.jobs[m.lease_job[l]].as_mut().unwrap().expired = false;
                    }
                    (Err(Error::LeaseLost { .. }), false) => tally.lease_lost += 1,
                    (got, want) => {
                        return Err(format!("heartbeat: {got:?}, model current: {want}"));
                    }
                }
            }
            Op::Complete(l) => {
                let Some(l) = m.lease(l) else { return Ok(()) };
                let want = m.current(l);
                match (self.complete(&m.leases[l]).await, want) {
                    (Ok(()), true) => {
                        m.complete(l);
                        tally.completed += 1;
                    }
                    (Err(Error::LeaseLost { .. }), false) => tally.lease_lost += 1,
                    (got, want) => return Err(format!("complete: {got:?}, model current: {want}")),
                }
            }
            Op::CompleteMany(ref ls) => {
                let ls: BTreeSet<usize> = ls.iter().filter_map(|&l| m.lease(l)).collect();
                let done: Vec<(Lease, Value)> = ls
                    .iter()
                    .map(|&l| (m.leases[l].clone(), json!(m.leases[l].token)))
                    .collect();
                let want_lost: Vec<i64> = ls
                    .iter()
                    .filter(|&&l| !m.current(l))
                    .map(|&l| m.leases[l].job_id)
                    .collect();
                let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted)
                    .await
                    .map_err(sql)?;
                let lost = job::complete_many(&mut *tx, &done).await.map_err(db)?;
                for &l in ls.iter().filter(|&&l| m.current(l)) {
                    record_effect(&mut tx, m.leases[l].job_id)
                        .await
                        .map_err(db)?;
                }
                tx.commit().await.map_err(sql)?;
                if lost != want_lost {
                    return Err(format!("complete_many lost {lost:?}, model: {want_lost:?}"));
                }
                tally.lease_lost += lost.len() as u64;
                let current: Vec<usize> = ls.into_iter().filter(|&l| m.current(l)).collect();
                for l in current {
                    m.complete(l);
                    tally.completed += 1;
                }
            }
            Op::Fail(l) => {
                let Some(l) = m.lease(l) else { return Ok(()) };
                let want = m.current(l);
                let got = job::fail(pool, &m.leases[l], "boom", &policy()).await;
                if !want {
                    return match got {
                        Err(Error::LeaseLost { .. }) => {
                            tally.lease_lost += 1;
                            Ok(())
                        }
                        got => Err(format!("fail: {got:?}, model: lease lost")),
                    };
                }
                let job = m.jobs[m.lease_job[l]].as_mut().unwrap();
                job.attempt_failed(JobStatus::Failed, false);
                let want = if job.status == JobStatus::Dead {
                    tally.dead += 1;
                    "dead"
                } else {
                    tally.failed += 1;
                    "retry"
                };
                match got {
                    Ok(FailOutcome::Dead { attempts }) if want == "dead" => {
                        if attempts != job.attempts {
                            return Err(format!("fail: dead at {attempts} attempts"));
                        }
                    }
                    Ok(FailOutcome::Retry { attempts, run_at }) if want == "retry" => {
                        let wait = run_at - OffsetDateTime::now_utc();
                        if attempts != job.attempts || wait < time::Duration::MINUTE {
                            return Err(format!("fail: retry {attempts} attempts in {wait}"));
                        }
                    }
                    got => return Err(format!("fail: {got:?}, model: {want}")),
                }
            }
            Op::Transition(j, from_failed, to_dead) => {
                let Some(j) = m.job(j) else { return Ok(()) };
                let from = if from_failed {
                    JobStatus::Failed
                } else {
                    JobStatus::Pending
                };
                let to = if to_dead {
                    JobStatus::Dead
                } else {
                    JobStatus::Completed
                };
                let want = m.jobs[j].as_ref().is_some_and(|job| job.status == from);
                let result = json!("transition");
                let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted)
                    .await
                    .map_err(sql)?;
                if to == JobStatus::Completed {
                    record_effect(&mut tx, m.ids[j]).await.map_err(db)?;
                }
                let (result_arg, error) = match to {
                    JobStatus::Completed => (Some(&result), None),
                    _ => (None, Some("cancelled")),
                };
                let got = job::transition(&mut *tx, m.ids[j], from, to, result_arg, error).await;
                match (got, want) {
                    (Ok(()), true) => {
                        tx.commit().await.map_err(sql)?;
                        let job = m.jobs[j].as_mut().unwrap();
                        job.finish(to);
                        if to == JobStatus::Completed {
                            job.result = Some(result);
                            m.effects[j] += 1;
                        }
                    }
                    (Err(Error::AlreadyHandled { .. }), false) => {
                        tx.rollback().await.map_err(sql)?;
                        tally.handled += 1;
                    }
                    (got, want) => {
                        return Err(format!("{from} -> {to}: {got:?}, model applies: {want}"));
                    }
                }
            }
            Op::Expire(j) => {
                let Some(j) = m.job(j) else { return Ok(()) };
                time_passes(pool, EXPIRE, m.ids[j]).await?;
                if let Some(job) = m.jobs[j].as_mut().filter(|j| j.lease.is_some()) {
                    job.expired = true;
                }
            }
            Op::MakeDue(j) => {
                let Some(j) = m.job(j) else { return Ok(()) };
                time_passes(pool, MAKE_DUE, m.ids[j]).await?;
                if let Some(job) = m.jobs[j].as_mut() {
                    job.due |= matches!(job.status, JobStatus::Pending | JobStatus::Failed);
                }
            }
            Op::Reap => {
                let reaper = Reaper::new(pool.clone(), ReaperConfig::default()).map_err(db)?;
                let counts = reaper.run_once().await.map_err(db)?;
                let (returned, dead) = m.reap(None);
                if (counts.returned, counts.dead) != (returned, dead) {
                    return Err(format!(
                        "reaped {counts:?}, model: {returned} returned, {dead} dead"
                    ));
                }
                tally.reaped += returned;
                tally.dead += dead;
            }
            Op::Redrive => {
                let redriver =
                    Redriver::new(pool.clone(), RedriverConfig::default()).map_err(db)?;
                let counts = redriver.run_once().await.map_err(db)?;
                let mut want = BTreeSet::new();
                for (j, job) in m.jobs.iter_mut().enumerate() {
                    if let Some(job) = job.as_mut()
                        && job.status == JobStatus::Failed
                        && job.due
                    {
                        job.status = JobStatus::Pending;
                        want.insert(m.ids[j]);
                    }
                }
                let got: BTreeSet<i64> = counts.ids.iter().copied().collect();
                if got != want || counts.redriven != want.len() as u64 {
                    return Err(format!("re-drove {counts:?}, model: {want:?}"));
                }
                tally.redriven += got.len() as u64;
            }
            Op::RetryDead(j) => {
                let Some(j) = m.job(j) else { return Ok(()) };
                let mut conn = pool.acquire().await.map_err(sql)?;
                let by = RetryBy {
                    who: "model",
                    reason: Some("the model retries"),
                };
                let got = job::retry_dead(&mut conn, m.ids[j], by).await;
                let was = m.jobs[j].as_ref().map(|job| job.status);
                match (got, was) {
                    (Ok(()), Some(JobStatus::Dead)) => {
                        let job = m.jobs[j].as_mut().unwrap();
                        job.status = JobStatus::Pending;
                        job.attempts = 0;
                        job.due = true;
                        job.aged = false;
                        tally.retried += 1;
                    }
                    (Err(Error::JobNotDead { status, .. }), was)
                        if status == was && was != Some(JobStatus::Dead) => {}
                    (got, was) => return Err(format!("retry_dead: {got:?}, model: {was:?}")),
                }
            }
            Op::Age(j) => {
                let Some(j) = m.job(j) else { return Ok(()) };
                time_passes(pool, AGE, m.ids[j]).await?;
                if let Some(job) = m.jobs[j].as_mut() {
                    job.aged |= job.status.is_terminal();
                }
            }
            Op::Maintenance => {
                let counts = maintenance::run_once(pool, &maintenance_config())
                    .await
                    .map_err(db)?;
                let (mut completed, mut dead) = (0, 0);
                for slot in &mut m.jobs {
                    if let Some(job) = slot.as_ref().filter(|j| j.aged) {
                        match job.status {
                            JobStatus::Completed => completed += 1,
                            _ => dead += 1,
                        }
                        *slot = None;
                    }
                }
                if (counts.completed_jobs, counts.dead_jobs) != (completed, dead) {
                    return Err(format!(
                        "maintenance deleted {counts:?}, model: {completed} completed, {dead} dead"
                    ));
                }
                tally.deleted += completed + dead;
            }
            Op::ClaimRace(j, a_commits) => {
                let Some(j) = m.job(j) else { return Ok(()) };
                self.claim_race(m, j, a_commits, tally).await?;
            }
            Op::ClaimRolledBack(j) => {
                let Some(j) = m.job(j) else { return Ok(()) };
                self.claim_rolled_back(m, j, tally).await?;
            }
            Op::HeartbeatRace(l, a_commits) => {
                let Some(l) = m.lease(l) else { return Ok(()) };
                self.heartbeat_race(m, l, a_commits, tally).await?;
            }
            Op::ReapRace(l, write, a_commits) => {
                let Some(l) = m.lease(l) else { return Ok(()) };
                self.reap_race(m, l, write, a_commits, tally).await?;
            }
        }
        Ok(())
    }

    /// Runs `ops` one by one, comparing every row with the model after
    /// each; `done` counts the steps of the case so far.
    async fn steps(
        &self,
        m: &mut Model,
        ops: &[Op],
        what: &str,
        done: &mut usize,
        tally: &mut Tally,
    ) -> Result<(), String> {
        for op in ops {
            let i = *done;
            self.step(m, op, tally)
                .await
                .map_err(|e| format!("{what} {i} {op:?}: {e}"))?;
            compare(self.pool, m)
                .await
                .map_err(|e| format!("after {what} {i} {op:?}: {e}"))?;
            *done += 1;
        }
        Ok(())
    }

    /// Two deliveries claim job `j` at once. When the job is claimable, A's
    /// claim takes its row in A's open transaction and B's claim must be
    /// seen waiting for A (pg_locks) before A ends; after A's COMMIT B gets
    /// `JobBusy` (processing), after A's ROLLBACK B wins. When its lease ran
    /// out on its last attempt, A's claim makes the job dead in A's open
    /// transaction and B's claim is seen waiting for A: after A's COMMIT B
    /// finds the job dead, after A's ROLLBACK B makes it dead; both hear
    /// `AlreadyHandled`, and the attempt is counted once. Otherwise neither
    /// claim takes anything and both see what a single claim would.
    async fn claim_race(
        &self,
        m: &mut Model,
        j: usize,
        a_commits: bool,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let (race, [_, b]) = (self.race, self.sessions);
        let id = m.ids[j];
        let want = m.claim_outcome(j);
        let kills = m.claim_kills(j);
        let harness = |e: pgonce_testkit::HarnessError| e.to_string();
        let (tx, got_a) = self.a_claims(m, j).await?;
        let pool_b = b.pool().clone();
        let claim_b = async move { job::claim(&pool_b, id, LEASE).await };
        if kills {
            tally.raced += 1;
            let waiting = self.waits_for_a(claim_b).await?;
            self.a_ends(tx, a_commits).await?;
            let got_b = waiting.resume().await.map_err(harness)?;
            if claim_seen(&got_b) != "already handled" {
                return Err(format!("B's claim: {}, model: dead", claim_seen(&got_b)));
            }
            m.claim_killed(j, tally);
            return Ok(());
        }
        let Ok(lease_a) = got_a else {
            // Nothing taken: B sees the same, without waiting.
            let got_b = race.step(b, "claim", claim_b).await.map_err(harness)?;
            tx.rollback().await.map_err(|e| e.to_string())?;
            if claim_seen(&got_b) != want {
                return Err(format!("B's claim: {}, model: {want}", claim_seen(&got_b)));
            }
            return Ok(());
        };
        tally.raced += 1;
        let waiting = self.waits_for_a(claim_b).await?;
        self.a_ends(tx, a_commits).await?;
        let got_b = waiting.resume().await.map_err(harness)?;
        let (winner, want_b) = if a_commits {
            (lease_a, "processing")
        } else {
            // A's lease was never committed: kept, to be presented late.
            m.remember(j, lease_a);
            match got_b {
                Ok(ref lease) => (lease.clone(), "lease"),
                Err(_) => return Err(format!("B's claim after A rolled back: {got_b:?}")),
            }
        };
        if claim_seen(&got_b) != want_b {
            return Err(format!(
                "B's claim: {}, model: {want_b}",
                claim_seen(&got_b)
            ));
        }
        tally.claimed += 1;
        tally.taken_over += m.taken_over(j);
        m.issue(j, winner)
    }

    /// Lease `l`'s holder heartbeats in a transaction A leaves open, and a
    /// delivery of its job's message claims the job (B). A current lease's
    /// heartbeat holds the row: a claim that would take the lease over
    /// (it ran out) must be seen waiting for A, and after A's COMMIT gets
    /// `JobBusy` (the lease live again, nothing counted), after A's
    /// ROLLBACK takes it over (its attempt counted), or, the lease run out
    /// on the job's last attempt, makes the job dead; any other claim
    /// passes A by, answered by the row as it was. A lease no longer
    /// current hears `LeaseLost`, holds nothing, and B's claim is what a
    /// single claim is.
    async fn heartbeat_race(
        &self,
        m: &mut Model,
        l: usize,
        a_commits: bool,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let (race, [a, b]) = (self.race, self.sessions);
        let harness = |e: pgonce_testkit::HarnessError| e.to_string();
        let j = m.lease_job[l];
        let id = m.ids[j];
        let current = m.current(l);
        let mut tx = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
            .await
            .map_err(|e| e.to_string())?;
        let beat = race
            .step(
                a,
                "heartbeat",
                job::heartbeat(&mut *tx, &m.leases[l], LEASE),
            )
            .await
            .map_err(harness)?;
        match (beat, current) {
            (Ok(renewed), true) if renewed.token == m.leases[l].token => {}
            (Err(Error::LeaseLost { .. }), false) => tally.lease_lost += 1,
            (beat, current) => {
                return Err(format!("A's heartbeat: {beat:?}, model current: {current}"));
            }
        }
        let takes_over = m.claim_outcome(j) == "lease";
        let kills = m.claim_kills(j);
        let writes = takes_over || kills;
        let pool_b = b.pool().clone();
        let claim_b = async move { job::claim(&pool_b, id, LEASE).await };
        let got_b = if current && writes {
            tally.beats_raced += 1;
            let waiting = self.waits_for_a(claim_b).await?;
            self.heartbeat_ends(m, l, tx, a_commits).await?;
            let got_b = waiting.resume().await.map_err(harness)?;
            let want = match (a_commits, takes_over) {
                (true, _) => "processing",
                (false, true) => "lease",
                (false, false) => "already handled",
            };
            if claim_seen(&got_b) != want {
                return Err(format!("B's claim: {}, model: {want}", claim_seen(&got_b)));
            }
            if kills && !a_commits {
                m.claim_killed(j, tally);
            }
            got_b
        } else {
            let want = m.claim_outcome(j);
            let got_b = race.step(b, "claim", claim_b).await.map_err(harness)?;
            if claim_seen(&got_b) != want {
                return Err(format!("B's claim: {}, model: {want}", claim_seen(&got_b)));
            }
            if let Err(Error::JobBusy { not_before, .. }) = got_b {
                m.jobs[j].as_ref().unwrap().check_not_before(not_before)?;
            }
            if kills {
                m.claim_killed(j, tally);
            }
            self.heartbeat_ends(m, l, tx, a_commits && current).await?;
            got_b
        };
        match got_b {
            Ok(lease) => {
                tally.claimed += 1;
                tally.taken_over += m.taken_over(j);
                m.issue(j, lease)
            }
            Err(Error::JobBusy { not_before, .. }) => {
                tally.busy += 1;
                if current && writes {
                    m.jobs[j].as_ref().unwrap().check_not_before(not_before)?;
                }
                Ok(())
            }
            Err(_) => {
                tally.handled += 1;
                Ok(())
            }
        }
    }

    /// Lease `l`'s holder writes in a transaction A leaves open while a
    /// reaper pass runs (B). A current lease's write holds the job's row:
    /// the pass skips it (it never waits), reaping every other expired
    /// lease, and what A commits stands (a completion records its side
    /// effect in A's transaction); rolled back, the job is as it was, for
    /// the next pass. A lease no longer current hears `LeaseLost`, holds
    /// nothing, and the pass reaps as any pass.
    async fn reap_race(
        &self,
        m: &mut Model,
        l: usize,
        write: HolderWrite,
        a_commits: bool,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let (race, [a, b]) = (self.race, self.sessions);
        let harness = |e: pgonce_testkit::HarnessError| e.to_string();
        let current = m.current(l);
        let j = m.lease_job[l];
        let lease = m.leases[l].clone();
        let mut tx = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
            .await
            .map_err(|e| e.to_string())?;
        let written = match write {
            HolderWrite::Heartbeat => race
                .step(a, "heartbeat", job::heartbeat(&mut *tx, &lease, LEASE))
                .await
                .map_err(harness)?
                .map(drop),
            HolderWrite::Complete => {
                record_effect(&mut tx, lease.job_id)
                    .await
                    .map_err(|e| e.to_string())?;
                race.step(
                    a,
                    "complete",
                    job::complete(&mut *tx, &lease, &json!(lease.token)),
                )
                .await
                .map_err(harness)?
            }
            HolderWrite::Fail => race
                .step(a, "fail", job::fail(&mut *tx, &lease, "boom", &policy()))
                .await
                .map_err(harness)?
                .map(drop),
        };
        match (&written, current) {
            (Ok(()), true) => {}
            (Err(Error::LeaseLost { .. }), false) => tally.lease_lost += 1,
            _ => {
                return Err(format!(
                    "A's {write:?}: {written:?}, model current: {current}"
                ));
            }
        }
        let reaper =
            Reaper::new(b.pool().clone(), ReaperConfig::default()).map_err(|e| e.to_string())?;
        let counts = race
            .step(b, "reap", reaper.run_once())
            .await
            .map_err(harness)?
            .map_err(|e| e.to_string())?;
        let (returned, dead) = m.reap(current.then_some(j));
        if (counts.returned, counts.dead) != (returned, dead) {
            return Err(format!(
                "reaped {counts:?} beside A's {write:?}, model: {returned} returned, {dead} dead"
            ));
        }
        tally.reaped += returned;
        tally.dead += dead;
        let commits = a_commits && current;
        self.a_ends(tx, commits).await?;
        if current {
            tally.reaps_raced += 1;
        }
        if commits {
            match write {
                HolderWrite::Heartbeat => m.jobs[j].as_mut().unwrap().expired = false,
                HolderWrite::Complete => {
                    m.complete(l);
                    tally.completed += 1;
                }
                HolderWrite::Fail => {
                    let job = m.jobs[j].as_mut().unwrap();
                    job.attempt_failed(JobStatus::Failed, false);
                    if job.status == JobStatus::Dead {
                        tally.dead += 1;
                    } else {
                        tally.failed += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Ends A's transaction holding lease `l`'s heartbeat: committed, the
    /// lease is live again.
    async fn heartbeat_ends(
        &self,
        m: &mut Model,
        l: usize,
        tx: sqlx::Transaction<'static, sqlx::Postgres>,
        commits: bool,
    ) -> Result<(), String> {
        self.a_ends(tx, commits).await?;
        if commits {
            m.jobs[m.lease_job[l]].as_mut().unwrap().expired = false;
        }
        Ok(())
    }

    /// B's `claim`, started and seen waiting for A (pg_locks).
    async fn waits_for_a(
        &self,
        claim: impl Future<Output = pgonce::Result<Lease>> + Send + 'static,
    ) -> Result<pgonce_testkit::Blocked<pgonce::Result<Lease>>, String> {
        let waiting = self
            .race
            .step_blocks(&self.sessions[1], "claim", claim)
            .await
            .map_err(|e| e.to_string())?;
        if waiting.blocked_by() != ["A"] {
            return Err(format!("B waited for {:?}", waiting.blocked_by()));
        }
        Ok(waiting)
    }

    /// Ends A's transaction `tx`: COMMIT when `commits`, else ROLLBACK.
    async fn a_ends(
        &self,
        tx: sqlx::Transaction<'static, sqlx::Postgres>,
        commits: bool,
    ) -> Result<(), String> {
        let a = &self.sessions[0];
        let ended = if commits {
            self.race.step(a, "COMMIT", tx.commit()).await
        } else {
            self.race.step(a, "ROLLBACK", tx.rollback()).await
        };
        ended.map_err(|e| e.to_string())?.map_err(|e| e.to_string())
    }

    /// A's claim of job `j` in a transaction A leaves open, its outcome
    /// checked against what a single claim must return.
    async fn a_claims(
        &self,
        m: &Model,
        j: usize,
    ) -> Result<
        (
            sqlx::Transaction<'static, sqlx::Postgres>,
            pgonce::Result<Lease>,
        ),
        String,
    > {
        let a = &self.sessions[0];
        let want = m.claim_outcome(j);
        let mut tx = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
            .await
            .map_err(|e| e.to_string())?;
        let got = self
            .race
            .step(a, "claim", job::claim(&mut *tx, m.ids[j], LEASE))
            .await
            .map_err(|e| e.to_string())?;
        if claim_seen(&got) != want {
            return Err(format!("A's claim: {}, model: {want}", claim_seen(&got)));
        }
        Ok((tx, got))
    }

    /// A claim of job `j` in A's transaction, which rolls back: the job is
    /// as it was (a takeover undone, its attempt not counted). B's
    /// REPEATABLE READ snapshot, taken while A was open, cannot see A end;
    /// the rolled-back lease, completed in it, is lost all the same, at
    /// once (not a serialization failure), and B's transaction goes on.
    async fn claim_rolled_back(
        &self,
        m: &mut Model,
        j: usize,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let (race, [a, b]) = (self.race, self.sessions);
        let harness = |e: pgonce_testkit::HarnessError| e.to_string();
        let text = |e: sqlx::Error| e.to_string();
        let (tx, got) = self.a_claims(m, j).await?;
        let mut older = pgonce::begin(b.pool(), IsolationLevel::RepeatableRead)
            .await
            .map_err(text)?;
        race.step(
            b,
            "snapshot",
            sqlx::query("SELECT count(*) FROM pgonce.jobs").execute(&mut *older),
        )
        .await
        .map_err(harness)?
        .map_err(text)?;
        race.step(a, "ROLLBACK", tx.rollback())
            .await
            .map_err(harness)?
            .map_err(text)?;
        if let Ok(lease) = got {
            tally.rolled_back += 1;
            let late = race
                .step(
                    b,
                    "complete",
                    job::complete(&mut *older, &lease, &json!(lease.token)),
                )
                .await
                .map_err(harness)?;
            if !matches!(late, Err(Error::LeaseLost { .. })) {
                return Err(format!("a rolled-back lease completed: {late:?}"));
            }
            // Kept, to be presented late again.
            m.remember(j, lease);
        }
        older.commit().await.map_err(text)?;
        Ok(())
    }
}

/// Time passing for one job, without waiting: its lease runs out.
const EXPIRE: &str = "UPDATE pgonce.jobs SET lease_expires_at = now() - interval '1 second' \
                      WHERE id = $1 AND status = 'processing'";
/// Its `run_at` (a delayed start, a retry's backoff) passes.
const MAKE_DUE: &str = "UPDATE pgonce.jobs SET run_at = now() - interval '1 second' \
                        WHERE id = $1 AND status IN ('pending', 'failed')";
/// It finished 30 days ago, past every retention.
const AGE: &str = "UPDATE pgonce.jobs SET finished_at = now() - interval '30 days' \
                   WHERE id = $1 AND status IN ('completed', 'dead')";

/// Runs one of the updates above on job `id`.
async fn time_passes(pool: &PgPool, update: &'static str, id: i64) -> Result<(), String> {
    sqlx::query(update)
        .bind(id)
        .execute(pool)
        .await
        .map_err(|e| format!("unexpected error: {e}"))?;
    Ok(())
}

async fn record_effect(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    job_id: i64,
) -> pgonce::Result<()> {
    sqlx::query("INSERT INTO model_effects (job_id) VALUES ($1)")
        .bind(job_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Every row, and every recorded effect, against the model.
async fn compare(pool: &PgPool, m: &Model) -> Result<(), String> {
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, status, attempts, lease_token, \
                coalesce(lease_expires_at < now(), false) AS expired, \
                run_at <= now() AS due, result, \
                coalesce(finished_at < now() - interval '8 days', false) AS aged \
         FROM pgonce.jobs ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .map_err(|e| format!("read rows: {e}"))?;
    let mut have = BTreeMap::new();
    for r in &rows {
        have.insert(r.id, r.view()?);
    }
    let want: BTreeMap<i64, View> = m
        .jobs
        .iter()
        .enumerate()
        .filter_map(|(j, job)| Some((m.ids[j], job.as_ref()?.view(&m.leases))))
        .collect();
    if have != want {
        return Err(format!("rows {have:?}, model {want:?}"));
    }
    #[derive(sqlx::FromRow)]
    struct Effects {
        job_id: i64,
        effects: i64,
    }
    let effects: Vec<Effects> =
        sqlx::query_as("SELECT job_id, count(*) AS effects FROM model_effects GROUP BY job_id")
            .fetch_all(pool)
            .await
            .map_err(|e| format!("read effects: {e}"))?;
    if let Some(e) = effects.iter().find(|e| e.effects > 1) {
        return Err(format!(
            "job {}'s side effect recorded {} times",
            e.job_id, e.effects
        ));
    }
    let have: BTreeMap<i64, u32> = effects
        .into_iter()
        .map(|e| (e.job_id, e.effects as u32))
        .collect();
    let want: BTreeMap<i64, u32> = (0..m.ids.len())
        .filter(|&j| m.effects[j] > 0)
        .map(|j| (m.ids[j], m.effects[j]))
        .collect();
    if have != want {
        return Err(format!("effects {have:?}, model {want:?}"));
    }
    Ok(())
}

/// Time passes: every lease runs out and is reaped, every retry comes due
/// and is re-driven, a worker claims whatever is runnable.
fn drain(m: &Model) -> Vec<Op> {
    let n = m.ids.len();
    let mut ops: Vec<Op> = (0..n).map(Op::Expire).collect();
    ops.push(Op::Reap);
    ops.extend((0..n).map(Op::MakeDue));
    ops.push(Op::Redrive);
    ops.push(Op::ClaimBatch(n.max(1) as i64));
    ops
}

/// The worker completes every job it holds a current lease of; then every
/// finished job ages past its retention and maintenance runs.
fn finish(m: &Model) -> Vec<Op> {
    let n = m.leases.len();
    let current = (0..n).filter(|&l| m.current(l)).map(|l| n - 1 - l);
    let mut ops = vec![Op::CompleteMany(current.collect())];
    ops.extend((0..m.ids.len()).map(Op::Age));
    ops.push(Op::Maintenance);
    ops
}

async fn run(h: &Harness<'_>, ops: &[Op], tally: &mut Tally) -> Result<(), String> {
    // Cases run one after another on one database: each starts empty, so
    // a pass's counts are this case's.
    for truncate in ["TRUNCATE pgonce.jobs CASCADE", "TRUNCATE model_effects"] {
        sqlx::query(truncate)
            .execute(h.pool)
            .await
            .map_err(|e| e.to_string())?;
    }
    let mut m = Model::default();
    let start = [
        Op::Enqueue {
            max_attempts: 2,
            later: false,
        },
        Op::Enqueue {
            max_attempts: 1,
            later: false,
        },
    ];
    let ops: Vec<Op> = start.into_iter().chain(ops.iter().cloned()).collect();
    let mut done = 0;
    h.steps(&mut m, &ops, "step", &mut done, tally).await?;
    // Time passes, the reaper, the re-driver and a worker run...
    let drained = drain(&m);
    h.steps(&mut m, &drained, "drain step", &mut done, tally)
        .await?;
    // ... the worker completes what it claimed, and everything finished
    // ages past its retention and goes.
    let finished = finish(&m);
    h.steps(&mut m, &finished, "drain step", &mut done, tally)
        .await?;
    // Every job finished, so maintenance deleted every one; the ones that
    // completed recorded their effect once.
    if let Some((j, job)) = m.jobs.iter().enumerate().find(|(_, job)| job.is_some()) {
        return Err(format!("job {j} stranded after the drain: {job:?}"));
    }
    Ok(())
}

/// Two races on jobs 0 and 1 (A commits; A rolls back and B wins), the
/// rolled-back lease presented late, job 1 failed to dead and retried by
/// an operator, job 0's lease run out and reaped; then job 2 failed, busy
/// until its retry comes due, and raced for once it has (a delivery of its
/// message claims it without waiting for the re-driver); its lease then
/// runs out, a takeover rolls back, and a claim takes it over. Job 3's
/// lease runs out and its holder's heartbeat races a claim twice: the
/// heartbeat committed keeps the lease, rolled back lets the claim take
/// it over. Job 4's lease runs out on its only attempt: two claims race,
/// A's (which makes it dead) rolls back and B's makes it dead. Job 5's
/// does too, and its holder's heartbeat races a claim: rolled back, the
/// claim makes the job dead. Job 6's lease runs out on its only attempt
/// and its holder's heartbeat, held open, is passed by a reaper pass, then
/// rolled back; its completion, held open, likewise, then committed.
fn scripted_case() -> Vec<Op> {
    vec![
        Op::ClaimRace(0, true),
        Op::ClaimRace(1, false),
        Op::Complete(1),
        Op::Fail(0),
        Op::RetryDead(1),
        Op::Expire(0),
        Op::Reap,
        Op::Enqueue {
            max_attempts: 3,
            later: false,
        },
        Op::Claim(2),
        Op::Fail(0),
        Op::Claim(2),
        Op::MakeDue(2),
        Op::ClaimRace(2, true),
        Op::Expire(2),
        Op::ClaimRolledBack(2),
        Op::Claim(2),
        Op::Enqueue {
            max_attempts: 3,
            later: false,
        },
        Op::Claim(3),
        Op::Expire(3),
        Op::HeartbeatRace(0, true),
        Op::Expire(3),
        Op::HeartbeatRace(0, false),
        Op::Enqueue {
            max_attempts: 1,
            later: false,
        },
        Op::Claim(4),
        Op::Expire(4),
        Op::ClaimRace(4, false),
        Op::Enqueue {
            max_attempts: 1,
            later: false,
        },
        Op::Claim(5),
        Op::Expire(5),
        Op::HeartbeatRace(0, false),
        Op::Enqueue {
            max_attempts: 1,
            later: false,
        },
        Op::Claim(6),
        Op::Expire(6),
        Op::ReapRace(0, HolderWrite::Heartbeat, false),
        Op::Expire(6),
        Op::ReapRace(0, HolderWrite::Complete, true),
    ]
}

#[test]
fn jobs_follow_the_reference_model_step_by_step() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt.block_on(fresh_database());
    let (pool, race, sessions) = rt.block_on(async {
        let pool = db.pool(4).await.unwrap();
        pgonce::migrate(&pool).await.unwrap();
        sqlx::query("CREATE TABLE model_effects (job_id bigint NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let race = Interleaving::new(db.options()).await.unwrap();
        let sessions = [
            race.session("A").await.unwrap(),
            race.session("B").await.unwrap(),
        ];
        (pool, race, sessions)
    });
    let h = Harness {
        pool: &pool,
        race: &race,
        sessions: &sessions,
    };
    // One fixed case first, so every run reaches the paths the assertion
    // at the end names, however few random cases it has.
    let mut scripted = Tally::default();
    if let Err(e) = rt.block_on(run(&h, &scripted_case(), &mut scripted)) {
        panic!("the scripted case: {e}");
    }
    let tally = support::check_model(
        file!(),
        16,
        proptest::collection::vec(op(), 1..60),
        scripted,
        |_, ops, tally| rt.block_on(run(&h, ops, tally)),
    );
    assert!(
        tally.raced >= 2
            && tally.dead > 0
            && tally.lease_lost > 0
            && tally.retried > 0
            && tally.reaped > 0
            && tally.taken_over > 0
            && tally.rolled_back > 0
            && tally.beats_raced >= 3
            && tally.claimed_dead >= 2
            && tally.reaps_raced >= 2,
        "the run reached races, dead jobs, lost leases, retries, takeovers, \
         rolled-back claims, heartbeats raced by takeovers and claims making \
         jobs dead: {tally:?}"
    );
}
