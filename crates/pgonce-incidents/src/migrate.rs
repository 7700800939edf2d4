//! The service's schema, embedded in the binary.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// The service's migrations (the `incidents` schema), versions 1001 and up,
/// kept in the same `_sqlx_migrations` table as pgonce's.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Applies pgonce's migrations and then the service's, with
/// [`pgonce::migrate::run`]: each in its own transaction under a
/// transaction-level lock, so it is safe from several processes at once and
/// through a transaction-mode pooler.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    pgonce::migrate(pool).await?;
    pgonce::migrate::run(pool, &MIGRATOR).await
}
