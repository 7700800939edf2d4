//! Crates from crates.io doing the same work as pgonce, one file each, so
//! each comparison runs in the same process on the same database: sqlxmq
//! for `pgonce bench jobs`, apalis-postgres for `pgonce bench queue`,
//! disintegrate-postgres for `pgonce bench events`.

mod apalis;
pub(super) mod disintegrate;
pub mod sqlxmq;

use sqlx::PgPool;

use super::queue::{Flow, Shape};

/// Every queue peer of `bench queue`, in turn, as `(strategy, batch, flow)`.
pub async fn queue_peers(
    pool: &PgPool,
    shape: Shape,
) -> anyhow::Result<Vec<(String, usize, Flow)>> {
    let mut rows = Vec::new();
    for batch in [1, 10] {
        let flow = apalis::run(pool, shape, batch).await?;
        rows.push((format!("apalis-postgres-b{batch}"), batch, flow));
    }
    Ok(rows)
}
