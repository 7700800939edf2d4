//! The library's schema, embedded in the binary.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// pgonce's migrations (the `pgonce` schema and the tables of each pattern).
///
/// Versions 1 to 999 are the library's. Applications that keep their own
/// migrations in the same `_sqlx_migrations` table use other versions and run
/// both migrators with `set_ignore_missing(true)`, as [`migrate`] does.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Applies pgonce's migrations that are not applied yet. Safe to run from
/// several processes at once: sqlx serialises them with an advisory lock.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut migrator = Migrator::with_migrations(MIGRATOR.migrations.to_vec());
    migrator.set_ignore_missing(true);
    migrator.run(pool).await
}
