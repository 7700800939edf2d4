//! The service's schema, embedded in the binary.

use std::ops::RangeInclusive;

use pgonce::migrate::Schema;
use sqlx::migrate::Migrator;
use sqlx::{PgConnection, PgPool};

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

/// The lowest version a newer build applied to `conn`'s database that
/// this build does not know: pgonce's ([`pgonce::migrate::LIBRARY_VERSIONS`])
/// first, then the service's (1000 to 1999); see
/// [`pgonce::migrate::newer_version`]. [`migrate`] refuses such a
/// database; a command that reads without migrating (`pgonce rollout`)
/// asks this first, so that it refuses it too.
pub async fn newer_version(conn: &mut PgConnection) -> Result<Option<i64>, sqlx::Error> {
    let library = pgonce::migrate::newer_version(
        &mut *conn,
        &pgonce::migrate::MIGRATOR,
        pgonce::migrate::LIBRARY_VERSIONS,
    )
    .await?;
    match library {
        Some(version) => Ok(Some(version)),
        None => pgonce::migrate::newer_version(&mut *conn, &MIGRATOR, SERVICE_VERSIONS).await,
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
