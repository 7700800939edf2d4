//! Crates from crates.io doing the work of a pgonce bench, one file each, so
//! the comparison runs in the same process on the same database: queue
//! crates for `pgonce bench queue` (`run_all` returns `(strategy, batch,
//! flow)` rows), disintegrate-postgres for `pgonce bench events`.

mod apalis;
pub(super) mod disintegrate;

use sqlx::PgPool;

use super::queue::{Flow, Shape};

/// Every peer, in turn.
pub async fn run_all(pool: &PgPool, shape: Shape) -> anyhow::Result<Vec<(String, usize, Flow)>> {
    let mut rows = Vec::new();
    for batch in [1, 10] {
        let flow = apalis::run(pool, shape, batch).await?;
        rows.push((format!("apalis-postgres-b{batch}"), batch, flow));
    }
    Ok(rows)
}
