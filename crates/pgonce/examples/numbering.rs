//! Gapless numbers per scope in your own table (pattern P2, the scoped
//! sequence).
//!
//! Invoices are numbered 1, 2, 3... per customer, with no duplicate and no
//! gap, while many are created at once. The number is taken as the last
//! step of the invoice's transaction, under the customer's advisory lock,
//! so one customer's invoices never wait for another's, and an invoice
//! that fails rolls back and frees its number for the next one.
//!
//! Run: `cargo run -p pgonce --example numbering`.

mod support;

use pgonce::IsolationLevel;
use pgonce::{Error, NumberedTable, Sequence, SequenceConfig};
use sqlx::PgPool;
use support::Result;

// The unique index on (customer, number) is required: it turns any misuse
// into an error instead of a duplicate. `check_schema` checks that it is there.
const SCHEMA: &str = "CREATE TABLE invoices (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text NOT NULL,
    number bigint NOT NULL,
    amount bigint NOT NULL CHECK (amount > 0),
    UNIQUE (customer, number))";

/// Creates one invoice and returns its number.
async fn invoice(
    pool: PgPool,
    numbers: Sequence,
    customer: &str,
    amount: i64,
) -> pgonce::Result<i64> {
    // READ COMMITTED: the default strategy reads max(number) after taking the
    // customer's lock, which needs a fresh snapshot per statement. Under
    // REPEATABLE READ pgonce refuses with Error::WrongIsolation.
    let tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted).await?;
    // ... the invoice's other writes go here, before the customer is locked ...
    let numbered = numbers
        .commit_numbered(
            tx,
            &customer,
            async |conn: &mut sqlx::PgConnection, number: i64| {
                sqlx::query("INSERT INTO invoices (customer, number, amount) VALUES ($1, $2, $3)")
                    .bind(customer)
                    .bind(number)
                    .bind(amount)
                    .execute(conn)
                    .await?;
                Ok(())
            },
        )
        .await?;
    Ok(numbered.number)
}

#[derive(sqlx::FromRow)]
struct CustomerNumbers {
    customer: String,
    numbers: Vec<i64>,
}

#[tokio::main]
async fn main() -> Result {
    let db = support::scratch("numbering").await?;
    sqlx::query(SCHEMA).execute(&db.pool).await?;
    let numbers = Sequence::new(
        NumberedTable::new("public.invoices", "customer", "number")?,
        SequenceConfig::default(), // an advisory lock per customer, then max + 1
    )?;
    numbers.check_schema(&db.pool).await?;

    // Twenty invoices at once for two customers; every fifth is for an
    // amount the table refuses, so its transaction rolls back.
    let mut tasks = Vec::new();
    for i in 0..20 {
        let customer = if i % 2 == 0 { "acme" } else { "globex" };
        let amount = if i % 5 == 4 { 0 } else { 100 + i };
        let (pool, numbers) = (db.pool.clone(), numbers.clone());
        tasks.push(tokio::spawn(async move {
            (customer, invoice(pool, numbers, customer, amount).await)
        }));
    }
    for task in tasks {
        match task.await? {
            (customer, Ok(number)) => println!("{customer}: invoice #{number}"),
            (customer, Err(Error::Database(e))) => {
                let why = e.as_database_error().map(|d| d.message().to_string());
                println!("{customer}: refused, {why:?}; rolled back, its number freed")
            }
            (_, Err(e)) => return Err(e.into()),
        }
    }

    let per_customer: Vec<CustomerNumbers> = sqlx::query_as(
        "SELECT customer, array_agg(number ORDER BY number) AS numbers
         FROM invoices GROUP BY customer ORDER BY customer",
    )
    .fetch_all(&db.pool)
    .await?;
    for row in &per_customer {
        println!("{}: {:?}", row.customer, row.numbers);
        let expected: Vec<i64> = (1..=row.numbers.len() as i64).collect();
        assert_eq!(
            row.numbers, expected,
            "numbers are 1..n: no duplicate, no gap"
        );
    }
    db.finish().await
}
