//! `pgonce::begin` under cancellation. A caller's future can be dropped at
//! any await (a request timeout, a `select!`, a worker task aborted as a
//! killed process would be). If that happens after the BEGIN reached the
//! server and before its answer was read, sqlx does not know the connection
//! is in a transaction and returns it to the pool as it is: every later
//! "autocommit" statement on it joins that transaction and is never
//! committed. A queue consumer that records its work there and then deletes
//! its message on another connection loses the message.

use std::task::Poll;
use std::time::Duration;

use pgonce::IsolationLevel;
use pgonce_testkit::fresh_database;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres, Transaction};

const APP: &str = "pgonce-begin-dropped";

/// A database with a `ledger` table; a pool of one connection named
/// [`APP`], and a control pool to look at it from outside.
async fn pool_of_one_and_control() -> (PgPool, PgPool) {
    let db = fresh_database().await;
    let control = db.pool(2).await.unwrap();
    sqlx::query("CREATE TABLE ledger (id int PRIMARY KEY)")
        .execute(&control)
        .await
        .unwrap();
    let options: PgConnectOptions = db.options().application_name(APP);
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    (pool, control)
}

/// The state of the pool's one backend, as the server sees it.
async fn backend_state(control: &PgPool) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE application_name = $1")
        .bind(APP)
        .fetch_optional(control)
        .await
        .unwrap()
}

/// Drops a `pgonce::begin` future at the worst moment: the server has run
/// its BEGIN (the backend is idle in a transaction), the caller has not
/// read the answer. Polled by hand, so the moment is seen in
/// `pg_stat_activity`, not guessed with a sleep.
async fn drop_begin_after_the_server_ran_it(
    pool: &PgPool,
    control: &PgPool,
    level: IsolationLevel,
) {
    loop {
        let begin = pgonce::begin(pool, level);
        tokio::pin!(begin);
        let ready: Option<Transaction<'static, Postgres>> = loop {
            match futures::poll!(begin.as_mut()) {
                Poll::Ready(tx) => break Some(tx.unwrap()),
                Poll::Pending => {}
            }
            // Not polled again until the server has answered or not: once
            // the BEGIN has been sent it runs whether or not we poll.
            let mut seen = None;
            for _ in 0..200 {
                seen = backend_state(control).await;
                if seen.as_deref() == Some("idle in transaction") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if seen.as_deref() == Some("idle in transaction") {
                break None;
            }
        };
        match ready {
            // The BEGIN ran and the future never saw its answer: drop it here.
            None => return,
            // It completed within one poll: end it and try again.
            Some(tx) => tx.rollback().await.unwrap(),
        }
    }
}

#[tokio::test]
async fn a_begin_dropped_after_the_server_ran_it_leaves_no_transaction_behind() {
    let (pool, control) = pool_of_one_and_control().await;
    // The pool's one connection exists before the race, so the begin's
    // first poll goes straight to the BEGIN.
    sqlx::query("SELECT 1").execute(&pool).await.unwrap();

    for (i, level) in IsolationLevel::ALL.into_iter().enumerate() {
        drop_begin_after_the_server_ran_it(&pool, &control, level).await;

        // The next user of the pool writes with no transaction of its own:
        // its statement must be committed when it returns.
        sqlx::query("INSERT INTO ledger (id) VALUES ($1)")
            .bind(i as i32)
            .execute(&pool)
            .await
            .unwrap();
        let committed: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM ledger WHERE id = $1)")
                .bind(i as i32)
                .fetch_one(&control)
                .await
                .unwrap();
        assert!(
            committed,
            "{level}: an autocommit INSERT after a dropped begin is not committed \
             (the pooled connection was left in the dropped BEGIN's transaction: {:?})",
            backend_state(&control).await
        );
        assert_ne!(
            backend_state(&control).await.as_deref(),
            Some("idle in transaction"),
            "{level}: the pooled connection is still in a transaction"
        );
    }
}

/// The other place a begin can be dropped: still waiting for a connection
/// of an exhausted pool. The BEGIN then runs later, when the connection is
/// free, with nobody waiting for it; it must be rolled back, not left open
/// on the connection for the next user. (Before begins ran in a task of
/// their own this held too: the BEGIN was never sent. Now it is sent, and
/// this is what shows the task's transaction is rolled back.)
#[tokio::test]
async fn a_begin_dropped_while_it_waits_for_a_connection_leaves_no_transaction_behind() {
    let (pool, control) = pool_of_one_and_control().await;
    let held = pool.acquire().await.unwrap();
    {
        let begin = pgonce::begin(&pool, IsolationLevel::ReadCommitted);
        tokio::pin!(begin);
        assert!(futures::poll!(begin.as_mut()).is_pending());
        // Let it reach the pool's queue before it is given up.
        for _ in 0..10 {
            tokio::task::yield_now().await;
            assert!(futures::poll!(begin.as_mut()).is_pending());
        }
    }
    drop(held);

    sqlx::query("INSERT INTO ledger (id) VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    let committed: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM ledger WHERE id = 1)")
        .fetch_one(&control)
        .await
        .unwrap();
    assert!(
        committed,
        "an autocommit INSERT after a begin dropped in the pool's queue is not committed: {:?}",
        backend_state(&control).await
    );
}
