//! Crates from crates.io doing the same work as pgonce, one file each, so
//! each comparison runs in the same process on the same database: sqlxmq
//! for `pgonce bench jobs`, pgmq and apalis-postgres for `pgonce bench
//! queue`, disintegrate-postgres for `pgonce bench events`.

mod apalis;
pub(super) mod disintegrate;
pub(crate) mod pgmq;
pub(crate) mod sqlxmq;

use std::time::Duration;

use anyhow::Context;
use sqlx::ConnectOptions;

use super::queue::{Flow, Shape};
use crate::scratch::RunDatabase;

/// A sqlx 0.8 pool of `max_connections` on the run's database, for the
/// peers built on sqlx 0.8 (`who` names them in errors).
pub(crate) async fn sqlx08_pool(
    db: &RunDatabase,
    max_connections: u32,
    who: &str,
) -> anyhow::Result<sqlx08::PgPool> {
    let url = db.options().to_url_lossy();
    let options: sqlx08::postgres::PgConnectOptions = url
        .as_str()
        .parse()
        .context("the scratch database's URL for sqlx 0.8")?;
    sqlx08::postgres::PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .with_context(|| format!("connecting {who}'s sqlx 0.8 pool"))
}

/// Every queue peer of `bench queue`, in turn, as `(strategy, batch, flow)`.
pub(crate) async fn queue_peers(
    db: &RunDatabase,
    shape: Shape,
    with_listen: bool,
) -> anyhow::Result<Vec<(String, usize, Flow)>> {
    let mut rows = Vec::new();
    let clients = (shape.producers + shape.consumers) as u32;
    let pgmq = pgmq::Peer::open(db, clients).await?;
    for batch in [1, 10] {
        let flow = pgmq.run(shape, batch, pgmq::Mode::ReadDelete).await?;
        rows.push((format!("pgmq-b{batch}"), batch, flow));
    }
    let flow = pgmq.run(shape, 1, pgmq::Mode::Pop).await?;
    rows.push(("pgmq-pop-b1".to_string(), 1, flow));
    // `with_listen: false`: not apalis-postgres, which LISTENs on its pool.
    for batch in [1, 10].into_iter().filter(|_| with_listen) {
        let flow = apalis::run(db.pool(), shape, batch).await?;
        rows.push((format!("apalis-postgres-b{batch}"), batch, flow));
    }
    Ok(rows)
}
