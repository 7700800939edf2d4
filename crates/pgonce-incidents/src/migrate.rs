//! The service's schema, embedded in the binary.

use std::ops::RangeInclusive;

use pgonce::migrate::Schema;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// The service's migrations (the `incidents` schema), versions 1001 and up,
/// kept in the same `_sqlx_migrations` table as pgonce's.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The versions of [`MIGRATOR`]'s migrations, present and to come: one it
/// does not know in this range was applied by a newer build.
pub const SERVICE_VERSIONS: RangeInclusive<i64> = 1000..=1999;

/// Checks first that the database is in UTF8
/// ([`pgonce::migrate::check_encoding`]): the service stores any text its
/// clients send, and the tables' length CHECKs count characters, as its
/// validation does; another encoding is refused with nothing applied.
///
/// Applies pgonce's migrations and then the service's, with
/// [`pgonce::migrate::run_owning`]: each in its own transaction under a
/// transaction-level lock, so it is safe from several processes at once and
/// through a transaction-mode pooler. A database a newer build migrated
/// (pgonce's or the service's) is refused with
/// [`MigrateError::VersionMissing`](sqlx::migrate::MigrateError::VersionMissing),
/// nothing applied.
///
/// Then the `incidents` schema is checked whole ([`pgonce::migrate::check_schema`]):
/// a table dropped by hand after its migration ran is named here, not met
/// by every request.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    pgonce::migrate::check_encoding(pool).await?;
    pgonce::migrate(pool).await?;
    pgonce::migrate::run_owning(pool, &MIGRATOR, SERVICE_VERSIONS).await?;
    pgonce::migrate::check_schema(pool, &SCHEMA).await
}

/// For a running service: the lowest version a newer build applied since
/// this one migrated, pgonce's ([`pgonce::migrate::LIBRARY_VERSIONS`])
/// first, then the service's ([`SERVICE_VERSIONS`]); see
/// [`pgonce::migrate::newer_version`]. [`migrate`] would refuse such a
/// database; a process that migrated before it meets the newer schema
/// statement by statement, and `/readyz` says so instead.
pub(crate) async fn newer_version(pool: &PgPool) -> Result<Option<i64>, sqlx::Error> {
    let library = pgonce::migrate::newer_version(
        pool,
        &pgonce::migrate::MIGRATOR,
        pgonce::migrate::LIBRARY_VERSIONS,
    )
    .await?;
    match library {
        Some(version) => Ok(Some(version)),
        None => pgonce::migrate::newer_version(pool, &MIGRATOR, SERVICE_VERSIONS).await,
    }
}

/// What [`MIGRATOR`]'s migrations make. A migration that adds a table or a
/// function adds it here (a test compares this with the catalog of a
/// freshly migrated database).
pub const SCHEMA: Schema = Schema {
    name: "incidents",
    tables: &[
        "api_keys",
        "entities",
        "incidents",
        "notifications",
        "observations",
        "organizations",
        "policies",
        "settings",
    ],
    functions: &[],
};
