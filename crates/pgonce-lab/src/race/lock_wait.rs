//! `pgonce race lock-wait`: the property every guard rests on. A
//! transaction-level advisory lock taken inside a transaction makes a second
//! session wait until the first commits; the same call outside a transaction
//! is released when its statement ends, so the second session does not wait
//! (seed 000's first failure mode).

use pgonce_testkit::{HarnessError, Interleaving};

use super::timeline_rows;
use crate::report::{Report, Row};
use crate::scratch::RunDatabase;

const KEY: i64 = 4242;
const LOCK: &str = "SELECT pg_advisory_xact_lock($1)";

pub async fn run(db: &RunDatabase) -> anyhow::Result<Report> {
    let mut report = Report::new("race", "lock-wait", db.environment().await?);

    let (waited, rows) = inside_transaction(db).await?;
    report.results.push(
        Row::new("xact-lock-in-transaction")
            .with("b_waited_for_a", waited)
            .with("invariant_held", waited),
    );
    report
        .sections
        .insert("timeline: xact-lock-in-transaction".into(), rows);
    report.verdict.check(
        waited,
        "inside a transaction, B waits for A's advisory lock until A commits",
    );

    let (waited, rows) = outside_transaction(db).await?;
    report.results.push(
        Row::new("xact-lock-outside-transaction")
            .with("b_waited_for_a", waited)
            .with("invariant_held", waited),
    );
    report
        .sections
        .insert("timeline: xact-lock-outside-transaction".into(), rows);
    report.verdict.check(
        !waited,
        "outside a transaction the same call protects nothing: B does not wait (shown, as expected)",
    );
    Ok(report)
}

async fn inside_transaction(db: &RunDatabase) -> anyhow::Result<(bool, Vec<crate::report::Row>)> {
    let race = Interleaving::new(db.options()).await?;
    let a = race.session("A").await?;
    let b = race.session("B").await?;
    let mut tx_a = race.step(&a, "BEGIN", a.pool().begin()).await??;
    race.step(
        &a,
        "pg_advisory_xact_lock(4242)",
        sqlx::query(LOCK).bind(KEY).execute(&mut *tx_a),
    )
    .await??;
    let waiting = race
        .step_blocks(
            &b,
            "pg_advisory_xact_lock(4242)",
            lock_in_transaction(b.pool().clone()),
        )
        .await;
    let waited = match waiting {
        Ok(waiting) => {
            race.step(&a, "COMMIT", tx_a.commit()).await??;
            waiting.resume().await??;
            true
        }
        Err(HarnessError::DidNotBlock { .. }) => {
            tx_a.commit().await?;
            false
        }
        Err(e) => return Err(e.into()),
    };
    Ok((
        waited,
        timeline_rows("xact-lock-in-transaction", &race.timeline()),
    ))
}

async fn outside_transaction(db: &RunDatabase) -> anyhow::Result<(bool, Vec<crate::report::Row>)> {
    let race = Interleaving::new(db.options()).await?;
    let a = race.session("A").await?;
    let b = race.session("B").await?;
    // Autocommit: the lock belongs to the statement's implicit transaction.
    race.step(
        &a,
        "pg_advisory_xact_lock(4242), no BEGIN",
        sqlx::query(LOCK).bind(KEY).execute(a.pool()),
    )
    .await??;
    let waiting = race
        .step_blocks(
            &b,
            "pg_advisory_xact_lock(4242)",
            lock_in_transaction(b.pool().clone()),
        )
        .await;
    let waited = match waiting {
        Ok(waiting) => {
            waiting.resume().await??;
            true
        }
        Err(HarnessError::DidNotBlock { .. }) => {
            race.note(&b, "got the lock at once: A's lock was already gone");
            false
        }
        Err(e) => return Err(e.into()),
    };
    Ok((
        waited,
        timeline_rows("xact-lock-outside-transaction", &race.timeline()),
    ))
}

async fn lock_in_transaction(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(LOCK).bind(KEY).execute(&mut *tx).await?;
    tx.commit().await
}
