//! The service's schema, embedded in the binary.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// The service's migrations (the `incidents` schema), versions 1001 and up,
/// kept in the same `_sqlx_migrations` table as pgonce's.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Applies pgonce's migrations and then the service's. Both migrators ignore
/// the other's versions. Safe to run from several processes at once.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    pgonce::migrate(pool).await?;
    let mut migrator = Migrator::with_migrations(MIGRATOR.migrations.to_vec());
    migrator.set_ignore_missing(true);
    migrator.run(pool).await
}
