//! A queue worker that decides slowly and writes through a guard (pattern
//! P1, the guarded write).
//!
//! Each message says "this entity looks unhealthy". The worker reads the
//! entity's open incidents, evaluates for a while with no connection held
//! and no transaction open, then opens an incident only if the set it
//! decided on is still the same, checked under the entity's advisory lock.
//!
//! Worker A thinks for longer than the queue's visibility timeout, so the
//! message is delivered again, to worker B, while A is still thinking. Both
//! decide "open one"; the guard lets exactly one of them write.
//!
//! Run: `cargo run -p pgonce --example guarded_worker` (a throwaway
//! PostgreSQL, or a scratch database on the server `DATABASE_URL` names).

mod support;

use std::time::Duration;

use pgonce::{
    Error, Guard, GuardConfig, LockKey, PgQueue, PgQueueOptions, Queue, QueueAttributes, ReadSet,
    ReceiveRequest, Received, SendMessage,
};
use sqlx::PgConnection;
use support::Result;

const SCHEMA: &str = "CREATE TABLE incidents (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    entity text NOT NULL,
    open boolean NOT NULL DEFAULT true)";

/// What the decision depends on: the ids of the entity's open incidents.
/// Read once for the decision, and again under the lock to compare.
async fn open_incidents(conn: &mut PgConnection, entity: &str) -> pgonce::Result<ReadSet> {
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM incidents WHERE entity = $1 AND open")
        .bind(entity)
        .fetch_all(conn)
        .await?;
    Ok(ReadSet::from_ids(ids))
}

/// Receives one message, waiting for one to become visible.
async fn receive(queue: &PgQueue) -> Result<Received> {
    loop {
        let wait = ReceiveRequest::default().wait(Duration::from_secs(5));
        if let Some(message) = queue.receive(wait).await?.pop() {
            return Ok(message);
        }
    }
}

/// One worker's handling of one delivery: decide, guarded write, delete.
/// (`pgonce::Worker` runs receive, handle and delete for you, with a
/// heartbeat that keeps a slow message invisible; this loop is written out
/// so that the redelivery happens.)
async fn handle(
    name: &str,
    queue: PgQueue,
    guard: Guard,
    message: Received,
    think: Duration,
) -> Result {
    let pool = queue.pool();
    let entity = message.body.as_str();
    // 1. A short read; its connection is back in the pool when it returns.
    let seen = guard
        .read(pool, async |c| open_incidents(c, entity).await)
        .await?;
    println!("{name}: {entity} has open incidents {seen}; thinking for {think:?}");
    // 2. The slow part (remote calls, a model...): no connection held.
    tokio::time::sleep(think).await;
    if seen.is_empty() {
        // 3. Lock the entity, re-read, compare, insert, commit: or Conflict.
        let key = LockKey::new("entity", entity)?;
        let insert = async |c: &mut PgConnection| {
            sqlx::query("INSERT INTO incidents (entity) VALUES ($1)")
                .bind(entity)
                .execute(c)
                .await?;
            Ok(())
        };
        match guard
            .write(
                pool,
                key,
                &seen,
                async |c| open_incidents(c, entity).await,
                insert,
            )
            .await
        {
            Ok(()) => println!("{name}: opened an incident for {entity}"),
            Err(Error::Conflict { found, .. }) => {
                println!("{name}: conflict, open incidents are now {found}: wrote nothing")
            }
            Err(e) => return Err(e.into()),
        }
    }
    // 4. Acknowledge. A's receipt went stale when the message was delivered
    // to B: its delete is refused, and B's delivery is the one that counts.
    match queue.delete(&message.receipt).await {
        Ok(()) => println!("{name}: deleted the message"),
        Err(Error::StaleReceipt { .. }) => println!("{name}: receipt stale (redelivered since)"),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result {
    let db = support::scratch("guarded_worker").await?;
    sqlx::query(SCHEMA).execute(&db.pool).await?;
    // A 1 s visibility timeout, polled often, so the redelivery comes soon.
    let attributes = QueueAttributes::default().visibility_timeout(Duration::from_secs(1));
    let options = PgQueueOptions {
        poll_interval: Duration::from_millis(100),
        ..PgQueueOptions::default()
    };
    let queue = PgQueue::create(&db.pool, "health-checks", attributes, options).await?;
    queue.send(SendMessage::new("entity-42")).await?;
    let guard = Guard::new("open-incident", GuardConfig::default())?;

    // Worker A takes the message and thinks for 3 s...
    let first = receive(&queue).await?;
    let a = tokio::spawn(handle(
        "A",
        queue.clone(),
        guard.clone(),
        first,
        Duration::from_secs(3),
    ));
    // ...so after 1 s the message is visible again, and worker B gets it.
    let second = receive(&queue).await?;
    println!("B: received it again (delivery {})", second.receive_count);
    handle(
        "B",
        queue.clone(),
        guard.clone(),
        second,
        Duration::from_millis(100),
    )
    .await?;
    a.await??;

    let open: i64 =
        sqlx::query_scalar("SELECT count(*) FROM incidents WHERE entity = 'entity-42' AND open")
            .fetch_one(&db.pool)
            .await?;
    println!("open incidents for entity-42: {open}");
    assert_eq!(
        open, 1,
        "two deliveries, two decisions: the guard lets one write"
    );
    drop(queue);
    db.finish().await
}
