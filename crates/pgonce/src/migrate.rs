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
//!    busy with a migration;
//! 2. create the bookkeeping table if it is missing (under the lock, so two
//!    first runs cannot race on it);
//! 3. read the migration's row: applied with the same checksum, nothing to
//!    do; applied with another checksum, [`MigrateError::VersionMismatch`];
//!    absent, run its SQL and insert its row;
//! 4. `COMMIT`, which releases the lock with the migration's effects.
//!
//! A crash at any step rolls the whole migration back, row included, so a
//! migration is never half applied nor recorded without its effects.

use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{Executor, PgPool};

use crate::lock::LockKey;

/// pgonce's migrations (the `pgonce` schema and the tables of each pattern).
///
/// Versions 1 to 999 are the library's. Applications that keep their own
/// migrations in the same `_sqlx_migrations` table use other versions; [`run`]
/// applies one set and leaves rows of other versions alone.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Applies pgonce's migrations that are not applied yet (see [`run`]).
pub async fn migrate(pool: &PgPool) -> Result<(), MigrateError> {
    run(pool, &MIGRATOR).await
}

/// Applies `migrator`'s migrations that are not applied yet, in version
/// order, each in its own transaction under a transaction-level advisory
/// lock (see the module docs). Safe to run from several processes at once,
/// directly or through a transaction-mode pooler. Rows of versions that
/// `migrator` does not know (another component's) are left alone.
pub async fn run(pool: &PgPool, migrator: &Migrator) -> Result<(), MigrateError> {
    let key =
        LockKey::new("pgonce.migrate", "_sqlx_migrations").expect("a constant, valid namespace");
    let mut migrations: Vec<&Migration> = migrator
        .iter()
        .filter(|m| !matches!(m.migration_type, MigrationType::ReversibleDown))
        .collect();
    migrations.sort_by_key(|m| m.version);
    for migration in migrations {
        if migration.no_tx {
            // A statement that cannot run in a transaction (CREATE INDEX
            // CONCURRENTLY) cannot be applied atomically with its row.
            return Err(MigrateError::Execute(sqlx::Error::Protocol(format!(
                "migration {} asks to run outside a transaction, which this runner does not do",
                migration.version
            ))));
        }
        apply_one(pool, key, migration).await?;
    }
    Ok(())
}

#[derive(sqlx::FromRow)]
struct AppliedRow {
    checksum: Vec<u8>,
}

async fn apply_one(pool: &PgPool, key: LockKey, migration: &Migration) -> Result<(), MigrateError> {
    let mut tx = crate::begin(pool, crate::IsolationLevel::ReadCommitted).await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(key.as_i64())
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
