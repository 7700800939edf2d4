//! `pgonce race jobs`: the SQS worker seed's duplicate execution (a crash
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
//!   deliveries ran the side effect before it (the seed's caveat).
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

use std::time::Duration;

use pgonce::Error;
use pgonce::job::{self, JobStatus, NewJob, Reaper, ReaperConfig};
use pgonce_testkit::{Interleaving, Session};
use serde_json::json;
use sqlx::PgPool;

use super::timeline_rows;
use crate::report::{Report, Row};
use crate::scratch::RunDatabase;

const LEASE: Duration = Duration::from_secs(300);

/// What one strategy's interleaving produced.
struct Outcome {
    transitions: u32,
    side_effects: i64,
    second: String,
    final_status: String,
    extra: Vec<(&'static str, serde_json::Value)>,
}

pub async fn run(db: &RunDatabase) -> anyhow::Result<Report> {
    sqlx::raw_sql(include_str!("sql/seed003_schema.sql"))
        .execute(db.pool())
        .await?;
    let mut report = Report::new("race", "jobs", db.environment().await?);

    type Expect = fn(&Outcome) -> (bool, bool, &'static str);
    let strategies: [(&str, Expect); 7] = [
        ("no-guard", |o| {
            let held = o.transitions == 1 && o.side_effects == 1;
            (
                held,
                o.transitions == 2 && o.side_effects == 2,
                "no-guard: both deliveries transition and run the side effect (shown, as expected)",
            )
        }),
        ("where-status", |o| {
            let held = o.transitions == 1 && o.side_effects == 1;
            (
                held,
                o.transitions == 1 && o.side_effects == 2,
                "where-status: one transition, but the side effect ran twice (the seed's caveat, shown)",
            )
        }),
        ("two-phase", |o| {
            let held =
                o.transitions == 1 && o.side_effects == 1 && o.second == "JobBusy (processing)";
            (
                held,
                held,
                "two-phase: exactly one transition and exactly one side effect; the loser sees JobBusy and keeps its message",
            )
        }),
        ("dedupe-key", |o| {
            let held = o.transitions == 1 && o.side_effects == 1;
            (
                held,
                held,
                "dedupe-key: the duplicate skips the effect: exactly one",
            )
        }),
        ("crash", |o| {
            let held = o.final_status == "completed"
                && o.side_effects == 1
                && o.extra
                    .iter()
                    .any(|(k, v)| *k == "redelivery_while_stuck" && v == "JobBusy (processing)");
            (
                held,
                held,
                "crash: the redelivery seeing JobBusy kept its message; after the reaper returned the dead claimer's job, that message completed it",
            )
        }),
        ("late-completion", |o| {
            let held = o.final_status == "completed" && o.second == "LeaseLost";
            (
                held,
                held,
                "late-completion: the worker whose lease was taken over cannot overwrite the new owner's result",
            )
        }),
        ("late-completion-heartbeat", |o| {
            let held = o.final_status == "completed" && o.side_effects == 1;
            (
                held,
                held,
                "late-completion-heartbeat: a heartbeat keeps the slow worker's lease: one side effect",
            )
        }),
    ];
    for (name, expect) in strategies {
        let race = Interleaving::new(db.options()).await?;
        let outcome = match name {
            "no-guard" => no_guard(db, &race).await?,
            "where-status" => where_status(db, &race).await?,
            "two-phase" => two_phase(db, &race).await?,
            "dedupe-key" => dedupe_key(db, &race).await?,
            "crash" => crash(db, &race).await?,
            "late-completion" => late_completion(db, &race, false).await?,
            _ => late_completion(db, &race, true).await?,
        };
        let (held, as_expected, reason) = expect(&outcome);
        let mut row = Row::new(name)
            .with("transitions_applied", outcome.transitions)
            .with("side_effects", outcome.side_effects)
            .with("second_delivery", &outcome.second)
            .with("final_status", &outcome.final_status)
            .with("invariant_held", held);
        for (k, v) in outcome.extra {
            row.set(k, v);
        }
        report.results.push(row);
        report.sections.insert(
            format!("timeline: {name}"),
            timeline_rows(name, &race.timeline()),
        );
        report.verdict.check(as_expected, reason);
    }
    Ok(report)
}

async fn new_job(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(job::enqueue(pool, &NewJob::new("summarise", json!({"doc": 7}))).await?)
}

/// The remote call: recorded on its own connection, committed at once.
async fn side_effect(pool: &PgPool, id: i64, by: &str) -> anyhow::Result<()> {
    sqlx::query("INSERT INTO seed003_side_effects (job_id, by_session) VALUES ($1, $2)")
        .bind(id)
        .bind(by)
        .execute(pool)
        .await?;
    Ok(())
}

async fn side_effects(pool: &PgPool, id: i64) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM seed003_side_effects WHERE job_id = $1")
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

fn describe<T>(r: &pgonce::Result<T>) -> String {
    match r {
        Ok(_) => "applied".into(),
        Err(Error::AlreadyHandled { .. }) => "AlreadyHandled".into(),
        Err(Error::JobBusy { status, .. }) => format!("JobBusy ({status})"),
        Err(Error::LeaseLost { .. }) => "LeaseLost".into(),
        Err(e) => format!("error: {e}"),
    }
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
    let result = job::get(pool, id).await?.and_then(|r| r.result);
    Ok(Outcome {
        transitions,
        side_effects: side_effects(pool, id).await?,
        second: "applied (overwrote A's result)".into(),
        final_status: final_status(pool, id).await?,
        extra: vec![("result", json!(result))],
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
    let mut tx_a = a
        .pool()
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?;
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
    race.note(&b, &format!("0 rows: {}", describe(&second)));
    Ok(Outcome {
        transitions: first.is_ok() as u32 + second.is_ok() as u32,
        side_effects: side_effects(pool, id).await?,
        second: describe(&second),
        final_status: final_status(pool, id).await?,
        extra: vec![],
    })
}

async fn two_phase(db: &RunDatabase, race: &Interleaving) -> anyhow::Result<Outcome> {
    let pool = db.pool();
    let id = new_job(pool).await?;
    let (a, b) = sessions(race).await?;
    let mut tx_a = a
        .pool()
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?;
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
                describe(&second)
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
        transitions,
        side_effects: side_effects(pool, id).await?,
        second: describe(&second),
        final_status: final_status(pool, id).await?,
        extra: vec![],
    })
}

async fn dedupe_key(db: &RunDatabase, race: &Interleaving) -> anyhow::Result<Outcome> {
    let pool = db.pool();
    let id = new_job(pool).await?;
    let message_id = format!("msg-{id}");
    let (a, b) = sessions(race).await?;
    let mut tx_a = a
        .pool()
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?;
    let first = race
        .step(
            &a,
            "mark message processed",
            pgonce::dedupe::mark_processed(&mut tx_a, "seed003", &message_id),
        )
        .await??;
    anyhow::ensure!(first, "A is the first delivery");
    // The effect is a database write in the same transaction as the mark.
    race.step(
        &a,
        "side effect (same transaction)",
        sqlx::query("INSERT INTO seed003_side_effects (job_id, by_session) VALUES ($1, 'A')")
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
            let mut tx = pool_b
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await?;
            let first = pgonce::dedupe::mark_processed(&mut tx, "seed003", &msg).await?;
            let mut transitioned = false;
            if first {
                sqlx::query(
                    "INSERT INTO seed003_side_effects (job_id, by_session) VALUES ($1, 'B')",
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
        transitions: t_a.is_ok() as u32 + b_transitioned as u32,
        side_effects: side_effects(pool, id).await?,
        second: if b_first {
            "applied"
        } else {
            "skipped (duplicate key)"
        }
        .into(),
        final_status: final_status(pool, id).await?,
        extra: vec![],
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
    let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
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
        describe(&stuck)
    );
    race.note(
        &b,
        &format!(
            "job stuck in processing: {}: message not acknowledged, it comes back",
            describe(&stuck)
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
        transitions: done.is_ok() as u32,
        side_effects: side_effects(pool, id).await?,
        second: describe(&done),
        final_status: final_status(pool, id).await?,
        extra: vec![
            ("reaped", json!(reaped.returned)),
            ("redelivery_while_stuck", json!(describe(&stuck))),
        ],
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
        race.note(&b, &format!("claim: {}", describe(&b_claim)));
    }
    let late = race
        .step(
            &a,
            "late complete with its old lease",
            job::complete(a.pool(), &lease_a, &json!({"by": "A"})),
        )
        .await?;
    race.note(&a, &describe(&late));
    transitions += late.is_ok() as u32;
    let result = job::get(pool, id).await?.and_then(|r| r.result);
    Ok(Outcome {
        transitions,
        side_effects: side_effects(pool, id).await?,
        second: describe(&late),
        final_status: final_status(pool, id).await?,
        extra: vec![
            ("reaped", json!(reaped.returned)),
            ("result", json!(result)),
        ],
    })
}
