//! A job with a lease, a worker that dies, the reaper, and another worker
//! that finishes the job exactly once (pattern P3, the conditional
//! transition with fenced leases).
//!
//! The job's row is its state machine: a worker claims it (pending to
//! processing) with a lease, and its completion counts only while that
//! lease is the job's current one. Worker A claims the job and stops
//! answering. Once A's lease has run out, the reaper puts the job back to
//! pending; worker B claims it, does the work and completes it. When A
//! wakes up and tries to complete, its old lease is refused: its write is
//! rolled back and B's outcome stands.
//!
//! Run: `cargo run -p pgonce --example job_lease`.

mod support;

use std::time::Duration;

use pgonce::Error;
use pgonce::IsolationLevel;
use pgonce::job::{self, Lease, NewJob, Reaper, ReaperConfig};
use serde_json::json;
use sqlx::PgPool;
use support::Result;

/// The work's effect: a receipt sent for the order, recorded in the same
/// transaction that completes the job, so both commit or neither does.
const SCHEMA: &str = "CREATE TABLE receipts_sent (job_id bigint NOT NULL, sent_by text NOT NULL)";

/// Does the work under `lease` and completes the job, in one transaction.
async fn finish(pool: &PgPool, worker: &str, lease: &Lease) -> pgonce::Result<()> {
    let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
    sqlx::query("INSERT INTO receipts_sent (job_id, sent_by) VALUES ($1, $2)")
        .bind(lease.job_id)
        .bind(worker)
        .execute(&mut *tx)
        .await?;
    // Fenced by the lease: LeaseLost, and nothing written, once it was reaped.
    match job::complete(&mut *tx, lease, &json!({ "sent_by": worker })).await {
        Ok(()) => {
            tx.commit().await?;
            println!("{worker}: receipt sent, job completed");
            Ok(())
        }
        Err(e) => {
            tx.rollback().await?;
            Err(e)
        }
    }
}

#[tokio::main]
async fn main() -> Result {
    let db = support::scratch("job_lease").await?;
    let pool = &db.pool;
    sqlx::query(SCHEMA).execute(pool).await?;
    let id = job::enqueue(pool, &NewJob::new("send-receipt", json!({ "order": 17 }))).await?;

    // Worker A claims the job for 1 s, then hangs (or crashes: same thing).
    let lease_a = job::claim(pool, id, Duration::from_secs(1)).await?;
    println!("A: claimed job {id} until {}", lease_a.expires_at);
    // While A's lease is live, another delivery of the job cannot claim it.
    // The job is not finished, so that delivery must not be acknowledged:
    // if A never comes back, it is what drives the job once reaped.
    match job::claim(pool, id, Duration::from_secs(30)).await {
        Err(Error::JobBusy { not_before, .. }) => {
            println!("B: job {id} is busy until {not_before:?}; keeping the message")
        }
        other => panic!("a second claim must be refused as busy: {other:?}"),
    }

    // The reaper returns jobs whose lease ran out (Reaper::run does this
    // pass every `interval`; one pass at a time here, to print it).
    let reaper = Reaper::new(pool.clone(), ReaperConfig::default())?;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let reaped = reaper.run_once().await?;
        if reaped.returned > 0 {
            println!("reaper: A's lease expired, job {id} back to pending");
            break;
        }
    }

    // Worker B, polling for runnable jobs, claims it and finishes it.
    let claimed = job::claim_batch(pool, "send-receipt", 10, Duration::from_secs(30)).await?;
    let lease_b = &claimed[0].lease;
    println!(
        "B: claimed job {id} (failed attempts so far: {})",
        claimed[0].attempts
    );
    finish(pool, "B", lease_b).await?;

    // A wakes up and completes with its old lease: refused.
    match finish(pool, "A", &lease_a).await {
        Err(Error::LeaseLost { .. }) => println!("A: lease lost, its receipt rolled back"),
        other => panic!("the reaped lease must be fenced off: {other:?}"),
    }

    let row = job::get(pool, id).await?.expect("the job exists");
    let sent: Vec<String> = sqlx::query_scalar("SELECT sent_by FROM receipts_sent")
        .fetch_all(pool)
        .await?;
    println!(
        "job {id}: {}, attempts {}, result {:?}; receipts sent by {sent:?}",
        row.status,
        row.attempts,
        row.result.clone().transpose()?
    );
    assert_eq!(row.status()?, job::JobStatus::Completed);
    assert_eq!(sent, ["B"], "the work's effect committed once");
    db.finish().await
}
