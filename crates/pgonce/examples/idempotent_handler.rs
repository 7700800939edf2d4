//! An idempotency key around a request handler (pattern P4): a retry gets
//! the first response, and the effect happens once.
//!
//! `create_payment` stands in for an HTTP handler. The client sends an
//! `Idempotency-Key` with each request and resends it with the same key
//! when it did not hear back. The wrapper holds the key while the handler
//! runs, stores the response in the same transaction as the handler's
//! writes, and answers a retry with the stored response instead of running
//! the handler again. The same key with a different request is refused.
//!
//! Run: `cargo run -p pgonce --example idempotent_handler`.

mod support;

use std::time::Duration;

use pgonce::Error;
use pgonce::IsolationLevel;
use pgonce::dedupe::{self, Acquired};
use serde_json::{Value, json};
use sqlx::PgConnection;
use support::Result;

const SCHEMA: &str = "CREATE TABLE payments (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account text NOT NULL,
    amount bigint NOT NULL)";

/// The handler: one payment, one row. Not idempotent by itself.
async fn create_payment(conn: &mut PgConnection, request: &Value) -> pgonce::Result<Value> {
    let id: i64 =
        sqlx::query_scalar("INSERT INTO payments (account, amount) VALUES ($1, $2) RETURNING id")
            .bind(request["account"].as_str())
            .bind(request["amount"].as_i64())
            .fetch_one(conn)
            .await?;
    Ok(json!({ "status": 201, "payment": id }))
}

/// The handler behind an idempotency key.
async fn with_key(pool: &sqlx::PgPool, key: &str, request: &Value) -> pgonce::Result<Value> {
    let fingerprint = dedupe::fingerprint(request)?;
    // Hold the key for up to 30 s: long enough for the handler; if this
    // process dies, the next identical request takes the key over after that.
    let hold = match dedupe::acquire(pool, "payments", key, &fingerprint, Duration::from_secs(30))
        .await?
    {
        Acquired::Process(hold) => hold,
        Acquired::Replay(response) => return Ok(response),
    };
    // The handler's writes and the stored response commit together.
    let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
    let response = match create_payment(&mut tx, request).await {
        Ok(response) => response,
        Err(e) => {
            tx.rollback().await?;
            // Give the key up so that a retry runs the handler afresh.
            dedupe::release(pool, &hold).await?;
            return Err(e);
        }
    };
    dedupe::finish(&mut *tx, &hold, &response).await?;
    tx.commit().await?;
    Ok(response)
}

#[tokio::main]
async fn main() -> Result {
    let db = support::scratch("idempotent_handler").await?;
    sqlx::query(SCHEMA).execute(&db.pool).await?;
    let request = json!({ "account": "acct-1", "amount": 2500 });

    let first = with_key(&db.pool, "key-7f3a", &request).await?;
    println!("first request: {first}");
    // The client timed out before it read the answer, and retries.
    let retry = with_key(&db.pool, "key-7f3a", &request).await?;
    println!("retry:         {retry} (the stored response)");
    assert_eq!(first, retry);

    // A different request under the same key is a client bug: refused.
    let other = json!({ "account": "acct-1", "amount": 9999 });
    match with_key(&db.pool, "key-7f3a", &other).await {
        Err(Error::IdempotencyMismatch { key }) => println!("other request, key {key}: refused"),
        outcome => panic!("a reused key must be refused: {outcome:?}"),
    }

    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&db.pool)
        .await?;
    println!("payments made: {payments}");
    assert_eq!(payments, 1, "the handler ran once for the key");
    db.finish().await
}
