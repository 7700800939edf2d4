//! The harness itself: a session that waits on another's advisory lock is
//! seen blocked, proceeds after the holder commits, and a step that does not
//! block is reported as such.

use pgonce_testkit::{HarnessError, Interleaving, StepEvent, fresh_database};

const LOCK: &str = "SELECT pg_advisory_xact_lock(4242)";

#[tokio::test]
async fn b_blocks_on_a_lock_that_a_holds_and_proceeds_after_a_commits() {
    let db = fresh_database().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();

    let mut tx_a = race
        .step(&a, "BEGIN", a.pool().begin())
        .await
        .unwrap()
        .unwrap();
    race.step(&a, "take lock 4242", sqlx::query(LOCK).execute(&mut *tx_a))
        .await
        .unwrap()
        .unwrap();

    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "take lock 4242", async move {
            let mut tx = pool_b.begin().await?;
            sqlx::query(LOCK).execute(&mut *tx).await?;
            tx.commit().await
        })
        .await
        .expect("B must be seen waiting for A's lock");
    assert_eq!(waiting.blocked_by(), ["A"]);

    race.step(&a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    waiting
        .resume()
        .await
        .unwrap()
        .expect("B proceeds once A committed");

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
