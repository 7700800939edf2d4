//! apalis-postgres 1.0 (sqlx 0.9, LISTEN/NOTIFY enabled): producers insert
//! tasks with the crate's own `push_tasks` (one task, or `batch` per
//! statement), one apalis worker per consumer fetches `batch` at a time and
//! marks each done. A message counts as consumed when its handler runs,
//! slightly before apalis records it done: if anything, in the peer's
//! favour.

use std::sync::Arc;
use std::time::Duration;

use apalis_core::error::BoxDynError;
use apalis_core::task::builder::TaskBuilder;
use apalis_core::task::data::Data;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_postgres::{Config, PostgresStorage};
use sqlx::PgPool;

use crate::bench::queue::{Flow, Meter, Shape, drive};

const QUEUE: &str = "pgonce-bench";

async fn handle(body: String, meter: Data<Arc<Meter>>) -> Result<(), BoxDynError> {
    meter.consumed(&body);
    Ok(())
}

pub(crate) async fn run(pool: &PgPool, shape: Shape, batch: usize) -> anyhow::Result<Flow> {
    PostgresStorage::<()>::setup(pool).await?;
    let produce = {
        let pool = pool.clone();
        move |m: Arc<Meter>, _p: usize| {
            let pool = pool.clone();
            async move {
                while m.may_send(batch).await {
                    let tasks = (0..batch)
                        .map(|_| {
                            let body = serde_json::to_vec(&m.stamp()).expect("a string serialises");
                            TaskBuilder::new(body).build()
                        })
                        .collect();
                    let pushed = async {
                        let mut conn = pool.acquire().await?;
                        apalis_postgres::queries::push_tasks(&mut *conn, QUEUE, tasks).await?;
                        Ok::<_, anyhow::Error>(())
                    };
                    if let Err(e) = pushed.await {
                        m.error(format!("{e:#}"));
                    }
                }
            }
        }
    };
    let consume = {
        let pool = pool.clone();
        move |m: Arc<Meter>, c: usize| {
            let config = Config::default()
                .queue(QUEUE)
                .batch_size(batch)
                .heartbeat_interval(Duration::from_secs(5));
            let backend = PostgresStorage::<String>::new(&pool)
                .with_config(config)
                .with_pubsub();
            let worker = WorkerBuilder::new(format!("bench-{batch}-{c}").as_str())
                .backend(backend)
                .data(m.clone())
                .build(handle);
            async move {
                let run = tokio::spawn(async move { worker.run().await });
                while m.running() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                run.abort();
            }
        }
    };
    let flow = drive(
        &format!("apalis-postgres b{batch}"),
        shape,
        pool,
        produce,
        consume,
    )
    .await;
    sqlx::query("DELETE FROM apalis.jobs")
        .execute(pool)
        .await
        .ok();
    Ok(flow)
}
