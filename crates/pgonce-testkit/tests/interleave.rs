//! The harness itself: a session that waits on another's advisory lock is
//! seen blocked, proceeds after the holder commits, and a step that does not
//! block is reported as such.

use pgonce_testkit::{BoxError, HarnessError, Interleaving, StepEvent, fresh_database};

const LOCK: &str = "SELECT pg_advisory_xact_lock(4242)";

#[tokio::test]
async fn b_blocks_on_a_lock_that_a_holds_and_proceeds_after_a_commits() -> Result<(), BoxError> {
    let db = fresh_database().await;
    let race = Interleaving::new(db.options()).await?;
    let a = race.session("A").await?;
    let b = race.session("B").await?;

    let mut tx_a = race.try_step(&a, "BEGIN", a.pool().begin()).await?;
    race.try_step(&a, "take lock 4242", sqlx::query(LOCK).execute(&mut *tx_a))
        .await?;

    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "take lock 4242", async move {
            let mut tx = pool_b.begin().await?;
            sqlx::query(LOCK).execute(&mut *tx).await?;
            tx.commit().await
        })
        .await?;
    assert_eq!(waiting.blocked_by(), ["A"]);

    race.try_step(&a, "COMMIT", tx_a.commit()).await?;
    waiting.try_resume().await?;

    let events: Vec<_> = race
        .timeline()
        .into_iter()
        .map(|s| (s.session, s.event))
        .collect();
    assert_eq!(
        events,
        [
            ("A".into(), StepEvent::Ran),
            ("A".into(), StepEvent::Ran),
            (
                "B".into(),
                StepEvent::Blocked {
                    by: vec!["A".into()]
                }
            ),
            ("A".into(), StepEvent::Ran),
            ("B".into(), StepEvent::Resumed),
        ]
    );
    Ok(())
}

#[tokio::test]
async fn a_step_that_does_not_block_is_reported() {
    let db = fresh_database().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let b = race.session("B").await.unwrap();
    let pool_b = b.pool().clone();
    let err = race
        .step_blocks(&b, "take a free lock", async move {
            let mut tx = pool_b.begin().await?;
            sqlx::query(LOCK).execute(&mut *tx).await?;
            tx.commit().await
        })
        .await
        .expect_err("nobody holds the lock, so B cannot block");
    assert!(matches!(err, HarnessError::DidNotBlock { .. }), "{err}");
}

/// A step that must succeed and fails says which session and step failed,
/// and keeps the step's own error as its source, behind one `?`.
#[tokio::test]
async fn a_failing_step_is_named_with_its_own_error_as_the_source() -> Result<(), BoxError> {
    let db = fresh_database().await;
    let race = Interleaving::new(db.options()).await?;
    let a = race.session("A").await?;
    let err = race
        .try_step(
            &a,
            "divide by zero",
            sqlx::query("SELECT 1 / 0").execute(a.pool()),
        )
        .await
        .expect_err("1 / 0 fails");
    let HarnessError::StepFailed {
        session,
        step,
        source,
    } = &err
    else {
        panic!("not a step failure: {err}");
    };
    assert_eq!((session.as_str(), step.as_str()), ("A", "divide by zero"));
    let source = source
        .downcast_ref::<sqlx::Error>()
        .expect("the step's sqlx error");
    assert_eq!(
        sqlstate(source).as_deref(),
        Some("22012"),
        "division_by_zero: {err}"
    );
    assert!(
        err.to_string()
            .starts_with("session A: step `divide by zero` failed")
    );
    Ok(())
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}
