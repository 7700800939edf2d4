//! `pgonce race lock-wait`: the property every guard rests on. A
//! transaction-level advisory lock taken inside a transaction makes a second
//! session wait until the first commits; the same call outside a transaction
//! is released when its statement ends, so the second session does not wait
//! (the guarded write's first failure mode: its re-read and compare run
//! unprotected).

use pgonce_testkit::{HarnessError, Interleaving, Step};

use super::timeline_rows;
use crate::report::{Environment, Report, Row};
use crate::scratch::RunDatabase;

const KEY: i64 = 4242;
const LOCK: &str = "SELECT pg_advisory_xact_lock($1)";

/// One case: whether B was seen waiting for A's lock, and the timeline.
#[derive(Debug, Clone)]
pub struct LockWaitCase {
    /// Whether B was seen blocked on A's lock (through `pg_blocking_pids`).
    pub b_waited_for_a: bool,
    pub(crate) timeline: Vec<Step>,
}

/// Everything `pgonce race lock-wait` replays.
#[derive(Debug, Clone)]
pub struct LockWaitRace {
    /// A takes the lock inside a transaction: B must wait.
    pub inside_transaction: LockWaitCase,
    /// A takes it in autocommit: released at once, B does not wait.
    pub outside_transaction: LockWaitCase,
}

pub(crate) async fn run(db: &RunDatabase) -> anyhow::Result<Report> {
    let race = replay(db).await?;
    Ok(report(&race, db.environment().await?))
}

/// Replays both cases on `db`.
pub async fn replay(db: &RunDatabase) -> anyhow::Result<LockWaitRace> {
    Ok(LockWaitRace {
        inside_transaction: inside_transaction(db).await?,
        outside_transaction: outside_transaction(db).await?,
    })
}

pub(crate) fn report(race: &LockWaitRace, environment: Environment) -> Report {
    let mut report = Report::new("race", "lock-wait", environment);
    let inside = &race.inside_transaction;
    report.results.push(
        Row::new("xact-lock-in-transaction")
            .with("b_waited_for_a", inside.b_waited_for_a)
            .with("invariant_held", inside.b_waited_for_a),
    );
    report.sections.insert(
        "timeline: xact-lock-in-transaction".into(),
        timeline_rows("xact-lock-in-transaction", &inside.timeline),
    );
    report.verdict.check(
        inside.b_waited_for_a,
        "inside a transaction, B waits for A's advisory lock until A commits",
    );
    let outside = &race.outside_transaction;
    report.results.push(
        Row::new("xact-lock-outside-transaction")
            .with("b_waited_for_a", outside.b_waited_for_a)
            .with("invariant_held", outside.b_waited_for_a),
    );
    report.sections.insert(
        "timeline: xact-lock-outside-transaction".into(),
        timeline_rows("xact-lock-outside-transaction", &outside.timeline),
    );
    report.verdict.check(
        !outside.b_waited_for_a,
        "outside a transaction the same call protects nothing: B does not wait (shown, as expected)",
    );
    report
}

async fn inside_transaction(db: &RunDatabase) -> anyhow::Result<LockWaitCase> {
    let race = Interleaving::new(db.options()).await?;
    let a = race.session("A").await?;
    let b = race.session("B").await?;
    let mut tx_a = race.try_step(&a, "BEGIN", a.pool().begin()).await?;
    race.try_step(
        &a,
        "pg_advisory_xact_lock(4242)",
        sqlx::query(LOCK).bind(KEY).execute(&mut *tx_a),
    )
    .await?;
    let waiting = race
        .step_blocks(
            &b,
            "pg_advisory_xact_lock(4242)",
            lock_in_transaction(b.pool().clone()),
        )
        .await;
    let waited = match waiting {
        Ok(waiting) => {
            race.try_step(&a, "COMMIT", tx_a.commit()).await?;
            waiting.try_resume().await?;
            true
        }
        Err(HarnessError::DidNotBlock { .. }) => {
            tx_a.commit().await?;
            false
        }
        Err(e) => return Err(e.into()),
    };
    Ok(LockWaitCase {
        b_waited_for_a: waited,
        timeline: race.timeline(),
    })
}

async fn outside_transaction(db: &RunDatabase) -> anyhow::Result<LockWaitCase> {
    let race = Interleaving::new(db.options()).await?;
    let a = race.session("A").await?;
    let b = race.session("B").await?;
    // Autocommit: the lock belongs to the statement's implicit transaction.
    race.try_step(
        &a,
        "pg_advisory_xact_lock(4242), no BEGIN",
        sqlx::query(LOCK).bind(KEY).execute(a.pool()),
    )
    .await?;
    let waiting = race
        .step_blocks(
            &b,
            "pg_advisory_xact_lock(4242)",
            lock_in_transaction(b.pool().clone()),
        )
        .await;
    let waited = match waiting {
        Ok(waiting) => {
            waiting.try_resume().await?;
            true
        }
        Err(HarnessError::DidNotBlock { .. }) => {
            race.note(&b, "got the lock at once: A's lock was already gone");
            false
        }
        Err(e) => return Err(e.into()),
    };
    Ok(LockWaitCase {
        b_waited_for_a: waited,
        timeline: race.timeline(),
    })
}

async fn lock_in_transaction(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(LOCK).bind(KEY).execute(&mut *tx).await?;
    tx.commit().await
}
