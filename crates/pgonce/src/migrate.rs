//! The library's schema, embedded in the binary, and a migration runner
//! that works behind a transaction-mode connection pooler.
//!
//! sqlx's own `Migrator::run` holds a session-level advisory lock for the
//! whole run (`pg_advisory_lock`, then `pg_advisory_unlock`). Behind
//! PgBouncer in transaction mode the two calls can land on different server
//! connections: the unlock fails, and a server connection keeps the lock
//! until it closes, stalling the next run. [`run`] keeps sqlx's bookkeeping
//! table (`_sqlx_migrations`, same columns, same checksums, so either runner
//! can follow the other) but applies each migration in a transaction of its
//! own under a transaction-level advisory lock, and decides whether it is
//! applied only once it holds that lock:
//!
//! 1. `BEGIN`; `pg_advisory_xact_lock(K)`, which waits for any other runner
//!    busy with a migration, as long as it takes: the `lock_timeout` the
//!    session inherited (an operator's `ALTER ROLE ... SET lock_timeout`)
//!    is lifted for this wait alone and bounds the migration's own
//!    statements as before (`statement_timeout` bounds every one);
//! 2. create the bookkeeping table if it is missing (under the lock, so two
//!    first runs cannot race on it);
//! 3. refuse a database a newer build has migrated: a row in the runner's
//!    own range of versions that it does not know is
//!    [`MigrateError::VersionMissing`] (see [`run_owning`]);
//! 4. read the migration's row: applied with the same checksum, nothing to
//!    do; applied with another checksum, [`MigrateError::VersionMismatch`];
//!    absent, run its SQL and insert its row;
//! 5. `COMMIT`, which releases the lock with the migration's effects.
//!
//! A crash at any step rolls the whole migration back, row included, so a
//! migration is never half applied nor recorded without its effects.

use std::ops::RangeInclusive;

use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{Executor, PgExecutor, PgPool};

use crate::lock::LockKey;

/// pgonce's migrations (the `pgonce` schema and the tables of each pattern).
///
/// Versions 1 to 999 are the library's. Applications that keep their own
/// migrations in the same `_sqlx_migrations` table use other versions; [`run`]
/// applies one set and leaves rows of other versions alone.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The versions of [`MIGRATOR`]'s migrations, present and to come.
pub const LIBRARY_VERSIONS: RangeInclusive<i64> = 1..=999;

/// Applies pgonce's migrations that are not applied yet (see [`run`]).
/// [`MigrateError::VersionMissing`], with nothing applied, when a newer
/// pgonce has migrated the database (see [`run_owning`]).
pub async fn migrate(pool: &PgPool) -> Result<(), MigrateError> {
    run_owning(pool, &MIGRATOR, LIBRARY_VERSIONS).await?;
    check_schema(pool, &SCHEMA).await
}

/// What a set of migrations leaves in the database: a schema, its tables
/// and its functions, by name. The bookkeeping rows say which migrations
/// ran, not that what they made is still there: [`check_schema`] looks.
#[derive(Debug, Clone, Copy)]
pub struct Schema {
    /// The schema's name.
    pub name: &'static str,
    /// Its tables, unqualified.
    pub tables: &'static [&'static str],
    /// Its functions, unqualified (one of a name's overloads is enough).
    pub functions: &'static [&'static str],
}

/// What [`MIGRATOR`]'s migrations make. A migration that adds a table or a
/// function adds it here (the migration tests compare this with the
/// catalog of a freshly migrated database).
pub const SCHEMA: Schema = Schema {
    name: "pgonce",
    tables: &[
        "events",
        "idempotency_keys",
        "job_retries",
        "jobs",
        "processed_messages",
        "queue",
        "queue_dedup",
        "queue_message",
        "sequence_counters",
    ],
    functions: &[
        "events_append",
        "events_append_one_tag_item",
        "events_append_tag_item",
        "events_check_tag_item",
        "events_decide",
        "events_decide_tag_item",
        "events_enter",
        "events_filter",
        "events_insert",
        "events_lock",
        "events_require_read_committed",
        "fence_lost",
        "job_claim",
        "lock_key",
        "queue_fifo_heads_after",
        "queue_lock_keys",
        "queue_pick_standard",
        "sequence_take",
    ],
};

/// Part of a migrated schema is missing: dropped by hand after its
/// migrations ran, while `_sqlx_migrations` still records them applied, so
/// no run would make it again. Returned by [`check_schema`] inside
/// [`MigrateError::Source`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaMissing {
    /// The schema itself when it is gone, else its missing tables and
    /// functions (`pgonce.queue_message`, `pgonce.lock_key()`).
    pub missing: Vec<String>,
}

impl std::fmt::Display for SchemaMissing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} missing: dropped by hand after the migrations that made them ran \
             (_sqlx_migrations records those as applied, so they do not run again); \
             restore from a backup",
            self.missing.join(", ")
        )
    }
}

impl std::error::Error for SchemaMissing {}

/// The database's encoding is not UTF8 (LATIN1, SQL_ASCII...). Returned by
/// [`check_encoding`] inside [`MigrateError::Source`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotUtf8 {
    /// The encoding the database has (`server_encoding`).
    pub encoding: String,
}

impl std::fmt::Display for NotUtf8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the database's encoding is {}, not UTF8: a character it lacks fails the \
             statement that stores it, and under SQL_ASCII lengths count bytes, not \
             characters; use a database created with ENCODING 'UTF8'",
            self.encoding
        )
    }
}

impl std::error::Error for NotUtf8 {}

/// Checks that the database's encoding is UTF8, so that it stores every
/// character a Rust `String` holds and PostgreSQL's `length()` counts
/// characters, as validation in Rust does. Otherwise [`NotUtf8`], in
/// [`MigrateError::Source`]: a caller that runs it before migrating
/// applies nothing to such a database.
pub async fn check_encoding(pool: &PgPool) -> Result<(), MigrateError> {
    let encoding: String = sqlx::query_scalar("SELECT current_setting('server_encoding')")
        .fetch_one(pool)
        .await?;
    if encoding == "UTF8" {
        Ok(())
    } else {
        Err(MigrateError::Source(Box::new(NotUtf8 { encoding })))
    }
}

/// Checks that `schema` and all its tables and functions exist: after its
/// migrations ran, one missing was dropped by hand, and a run that
/// reported success would leave every statement on it to fail later.
/// [`SchemaMissing`], in
/// [`MigrateError::Source`], names what is missing (the schema alone when
/// it is gone).
pub async fn check_schema(pool: &PgPool, schema: &Schema) -> Result<(), MigrateError> {
    let missing: Vec<String> = sqlx::query_scalar(include_str!("migrate/sql/missing_objects.sql"))
        .bind(schema.name)
        .bind(schema.tables)
        .bind(schema.functions)
        .fetch_all(pool)
        .await?;
    if missing.is_empty() {
        Ok(())
    } else {
        Err(MigrateError::Source(Box::new(SchemaMissing { missing })))
    }
}

/// Applies `migrator`'s migrations that are not applied yet, in version
/// order, each in its own transaction under a transaction-level advisory
/// lock (see the module docs). Safe to run from several processes at once,
/// directly or through a transaction-mode pooler. Rows of versions that
/// `migrator` does not know (another component's) are left alone.
pub async fn run(pool: &PgPool, migrator: &Migrator) -> Result<(), MigrateError> {
    // An empty range: `run` owns no version beyond its migrator's own.
    run_owning(pool, migrator, RangeInclusive::new(1, 0)).await
}

/// [`run`], for a `migrator` whose migrations take the versions `owned`,
/// present and to come. An applied version in `owned` that `migrator`
/// does not know was applied by a newer build: its schema is ahead of this
/// code, which may not read or write it as that build does, and an older
/// migration applied now would run against a schema it was not written
/// for. [`MigrateError::VersionMissing`] names the lowest such version;
/// it is checked under the lock, before each migration, so nothing is
/// applied after a newer runner's migration either. Rows outside `owned`
/// (another component's) are left alone.
pub async fn run_owning(
    pool: &PgPool,
    migrator: &Migrator,
    owned: RangeInclusive<i64>,
) -> Result<(), MigrateError> {
    let key =
        LockKey::new("pgonce.migrate", "_sqlx_migrations").expect("a constant, valid namespace");
    let mut migrations: Vec<&Migration> = migrator
        .iter()
        .filter(|m| !matches!(m.migration_type, MigrationType::ReversibleDown))
        .collect();
    migrations.sort_by_key(|m| m.version);
    let known = applied_versions(migrator);
    let runner = Runner {
        key,
        owned: &owned,
        known: &known,
    };
    for migration in migrations {
        if migration.no_tx {
            // A statement that cannot run in a transaction (CREATE INDEX
            // CONCURRENTLY) cannot be applied atomically with its row.
            return Err(MigrateError::Execute(sqlx::Error::Protocol(format!(
                "migration {} asks to run outside a transaction, which this runner does not do",
                migration.version
            ))));
        }
        runner.apply_one(pool, migration).await?;
    }
    Ok(())
}

/// The lowest version applied to `executor`'s database in `owned` that is
/// none of `known`: applied by a newer build of the same migrations.
async fn unknown_version<'e>(
    executor: impl PgExecutor<'e>,
    owned: &RangeInclusive<i64>,
    known: &[i64],
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(include_str!("migrate/sql/unknown_version.sql"))
        .bind(owned.start())
        .bind(owned.end())
        .bind(known)
        .fetch_optional(executor)
        .await
}

/// The versions of `migrator`'s migrations that a run applies.
fn applied_versions(migrator: &Migrator) -> Vec<i64> {
    let mut versions: Vec<i64> = migrator
        .iter()
        .filter(|m| !matches!(m.migration_type, MigrationType::ReversibleDown))
        .map(|m| m.version)
        .collect();
    versions.sort_unstable();
    versions
}

/// For a process already running: the lowest version in `owned` applied
/// to the database that `migrator` does not know, if any. A newer build
/// has migrated the database since this one did (a rolling deploy, that
/// build's `pgonce migrate`): this build's statements were written for
/// the schema before, and [`run_owning`] would refuse it
/// ([`MigrateError::VersionMissing`]). One statement that writes nothing;
/// an error when the database was never migrated (no `_sqlx_migrations`).
pub async fn newer_version<'e>(
    executor: impl PgExecutor<'e>,
    migrator: &Migrator,
    owned: RangeInclusive<i64>,
) -> Result<Option<i64>, sqlx::Error> {
    unknown_version(executor, &owned, &applied_versions(migrator)).await
}

#[derive(sqlx::FromRow)]
struct AppliedRow {
    checksum: Vec<u8>,
}

/// What every migration's transaction needs: the lock, and which applied
/// versions are this runner's.
struct Runner<'a> {
    key: LockKey,
    owned: &'a RangeInclusive<i64>,
    known: &'a [i64],
}

impl Runner<'_> {
    async fn apply_one(&self, pool: &PgPool, migration: &Migration) -> Result<(), MigrateError> {
        let mut tx = crate::begin(pool, crate::IsolationLevel::ReadCommitted).await?;
        // Waits for another runner's migration as long as it takes (a
        // migration may build an index for minutes): the lock statement
        // lifts the lock_timeout the session inherited (an operator's
        // ALTER ROLE ... SET lock_timeout) for itself alone, so the
        // migration's own statements keep it.
        sqlx::query(crate::lock::LOCK_MANY_SQL)
            .bind(vec![self.key.as_i64()])
            .execute(&mut *tx)
            .await?;
        tx.execute(
            "CREATE TABLE IF NOT EXISTS _sqlx_migrations (
             version BIGINT PRIMARY KEY,
             description TEXT NOT NULL,
             installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
             success BOOLEAN NOT NULL,
             checksum BYTEA NOT NULL,
             execution_time BIGINT NOT NULL
         )",
        )
        .await?;
        if let Some(version) = unknown_version(&mut *tx, self.owned, self.known).await? {
            return Err(MigrateError::VersionMissing(version));
        }
        let applied: Option<AppliedRow> =
            sqlx::query_as("SELECT checksum FROM _sqlx_migrations WHERE version = $1")
                .bind(migration.version)
                .fetch_optional(&mut *tx)
                .await?;
        match applied {
            Some(row) if row.checksum == *migration.checksum => {}
            Some(_) => return Err(MigrateError::VersionMismatch(migration.version)),
            None => {
                let started = std::time::Instant::now();
                tx.execute(migration.sql.clone())
                    .await
                    .map_err(|e| MigrateError::ExecuteMigration(e, migration.version))?;
                sqlx::query(
                    "INSERT INTO _sqlx_migrations
                     (version, description, success, checksum, execution_time)
                 VALUES ($1, $2, TRUE, $3, $4)",
                )
                .bind(migration.version)
                .bind(&*migration.description)
                .bind(&*migration.checksum)
                .bind(i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX))
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }
}
