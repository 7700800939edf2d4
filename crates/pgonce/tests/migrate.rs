//! The migration runner against a real PostgreSQL: two runners on one
//! empty database, one held inside a migration while the other waits; a
//! database a newer pgonce migrated; a migration failing half way. (Runs
//! through a transaction-mode pooler are in `pooler.rs`.)

use std::sync::LazyLock;

use pgonce::migrate::{self, MIGRATOR};
use pgonce_testkit::{
    Interleaving, ScratchDatabase, Session, fresh_database, fresh_migrated_database,
};
use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{PgPool, Postgres, Transaction};

fn migration(version: i64, sql: &'static str) -> Migration {
    Migration::new(
        version,
        format!("test {version}").into(),
        MigrationType::Simple,
        sqlx::SqlSafeStr::into_sql_str(sql),
        false,
    )
}

async fn applied(pool: &PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Migration 1 writes to `public.gate`, which the test locks to hold a
/// runner inside it.
static GATED: LazyLock<Migrator> = LazyLock::new(|| {
    Migrator::with_migrations(vec![
        migration(
            1,
            "INSERT INTO public.gate VALUES (1); CREATE TABLE public.made (n int)",
        ),
        migration(2, "INSERT INTO public.made VALUES (2)"),
    ])
});

/// An empty database (no bookkeeping table yet) with `public.gate`, and a
/// pool of two on it for the checks.
async fn gated_database() -> (ScratchDatabase, PgPool) {
    let db = fresh_database().await;
    let pool = db.pool(2).await.unwrap();
    sqlx::query("CREATE TABLE public.gate (n int)")
        .execute(&pool)
        .await
        .unwrap();
    (db, pool)
}

/// `public.gate` locked by a transaction of `gate`: a runner of [`GATED`]
/// is held inside migration 1 until that transaction ends.
async fn lock_gate(race: &Interleaving, gate: &Session) -> Transaction<'static, Postgres> {
    let mut held = race
        .try_step(gate, "BEGIN", gate.pool().begin())
        .await
        .unwrap();
    race.try_step(
        gate,
        "LOCK TABLE gate",
        sqlx::query("LOCK TABLE public.gate IN ACCESS EXCLUSIVE MODE").execute(&mut *held),
    )
    .await
    .unwrap();
    held
}

/// Two runners started at once on an empty database (no bookkeeping table
/// yet): the first is held inside its first migration, the second is seen
/// waiting on the first's lock, and once the first is let go each
/// migration has run once and both runners succeed.
#[tokio::test]
async fn a_second_runner_waits_for_the_first_and_finds_its_migrations_applied() {
    second_runner_waits_for_the_first(None).await;
}

/// A runner waits for another runner's migration as long as it takes,
/// whatever lock_timeout its session inherited (an operator's `ALTER ROLE
/// ... SET lock_timeout`; here set on the session): held behind the first
/// runner, which is itself held inside its first migration, the second is
/// still waiting at four times that timeout and succeeds once the first is
/// let go. Inheriting it, the second runner failed after 50 ms with
/// PostgreSQL's 55P03 and applied nothing, although the first was merely
/// busy.
#[tokio::test]
async fn a_runner_waits_for_another_past_the_sessions_lock_timeout() {
    second_runner_waits_for_the_first(Some(50)).await;
}

/// The two runners' race, the second's session with `lock_timeout` set to
/// `lock_timeout_ms` if given: then it must still be waiting at four times
/// that before the first is let go.
async fn second_runner_waits_for_the_first(lock_timeout_ms: Option<i32>) {
    let (db, pool) = gated_database().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (gate, first, second) = (
        race.session("gate").await.unwrap(),
        race.session("first").await.unwrap(),
        race.session("second").await.unwrap(),
    );
    if let Some(ms) = lock_timeout_ms {
        second
            .set("lock_timeout", &format!("{ms}ms"))
            .await
            .unwrap();
    }
    let held = lock_gate(&race, &gate).await;
    let pool_first = first.pool().clone();
    let running = race
        .step_blocks(&first, "migrate", async move {
            migrate::run(&pool_first, &GATED).await
        })
        .await
        .unwrap();
    assert_eq!(running.blocked_by(), ["gate"]);
    let pool_second = second.pool().clone();
    let mut waiting = race
        .step_blocks(&second, "migrate", async move {
            migrate::run(&pool_second, &GATED).await
        })
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["first"]);
    if let Some(ms) = lock_timeout_ms {
        waiting = waiting.still_waiting_after(4 * ms).await.unwrap();
    }
    race.try_step(&gate, "COMMIT", held.commit()).await.unwrap();
    running.try_resume().await.unwrap();
    waiting.try_resume().await.unwrap();
    assert_eq!(applied(&pool).await, [1, 2]);
    assert_eq!(count(&pool, "public.gate").await, 1);
    assert_eq!(count(&pool, "public.made").await, 1);
}

/// The runner lifts the session's lock_timeout for its wait for another
/// runner only: a migration's own statements keep it. A runner under
/// lock_timeout 50 ms whose migration meets a table locked by someone else
/// fails with PostgreSQL's 55P03 and applies nothing.
#[tokio::test]
async fn a_migrations_own_statements_keep_the_sessions_lock_timeout() {
    let (db, pool) = gated_database().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (gate, runner) = (
        race.session("gate").await.unwrap(),
        race.session("runner").await.unwrap(),
    );
    runner.set("lock_timeout", "50ms").await.unwrap();
    let held = lock_gate(&race, &gate).await;
    let refused = migrate::run(runner.pool(), &GATED).await;
    let Err(MigrateError::ExecuteMigration(e, 1)) = &refused else {
        panic!("{refused:?}");
    };
    assert_eq!(pgonce::error::sqlstate_of(e).as_deref(), Some("55P03"));
    race.try_step(&gate, "ROLLBACK", held.rollback())
        .await
        .unwrap();
    let bookkeeping: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations')::text")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        bookkeeping, None,
        "nothing applied, the bookkeeping table neither"
    );
}

/// A database a newer pgonce migrated holds a row of pgonce's range
/// (1 to 999) that this build does not know: its schema is ahead of this
/// code. `migrate` refuses it with `VersionMissing`, naming the version,
/// and applies nothing (here: the known migration whose row is missing
/// stays unapplied). A row outside the range, another component's, is
/// left alone.
#[tokio::test]
async fn a_database_a_newer_pgonce_migrated_is_refused_with_nothing_applied() {
    let (_db, pool) = fresh_migrated_database(2, pgonce::migrate).await;
    let last = MIGRATOR.iter().map(|m| m.version).max().unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (1001, 'another component', true, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    migrate::migrate(&pool).await.unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (998, 'from a newer pgonce', true, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
        .bind(last)
        .execute(&pool)
        .await
        .unwrap();
    let refused = migrate::migrate(&pool).await;
    assert!(
        matches!(refused, Err(MigrateError::VersionMissing(998))),
        "{refused:?}"
    );
    let versions = applied(&pool).await;
    assert!(!versions.contains(&last), "{versions:?}");
    assert!(versions.contains(&998) && versions.contains(&1001));
}

/// Each migration runs in a transaction of its own: one failing half way
/// is reported with its version and the statement's error, leaves nothing
/// of itself (neither its first statement's table nor its row), and the
/// migrations before it applied; the ones after it are not run.
#[tokio::test]
async fn a_migration_failing_half_way_leaves_nothing_of_itself() {
    let db = fresh_database().await;
    let pool = db.pool(2).await.unwrap();
    let failing = Migrator::with_migrations(vec![
        migration(1, "CREATE TABLE public.one (n int)"),
        migration(
            2,
            "CREATE TABLE public.two (n int); INSERT INTO public.two VALUES (1); SELECT 1 / 0",
        ),
        migration(3, "CREATE TABLE public.three (n int)"),
    ]);
    let failed = migrate::run(&pool, &failing).await.unwrap_err();
    let text = failed.to_string();
    assert!(
        matches!(failed, MigrateError::ExecuteMigration(_, 2)),
        "{failed:?}"
    );
    assert!(
        text.contains("migration 2") && text.contains("division by zero"),
        "{text}"
    );
    assert_eq!(applied(&pool).await, [1]);
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(tables, ["_sqlx_migrations", "one"]);
}

/// `migrate::SCHEMA`, what `migrate` checks is still there after a run, is
/// what the migrations make: a migration adding a table or a function that
/// the list lacks fails here, and so does a name in the list that none
/// makes.
#[tokio::test]
async fn the_schema_checked_after_a_run_is_what_the_migrations_make() {
    let (_db, pool) = fresh_migrated_database(1, pgonce::migrate).await;
    let catalog = pgonce_testkit::schema_catalog(&pool, migrate::SCHEMA.name)
        .await
        .unwrap();
    assert_eq!(catalog.tables, migrate::SCHEMA.tables);
    assert_eq!(catalog.functions, migrate::SCHEMA.functions);
}

/// A table or function dropped by hand after its migration ran is named by
/// the next run, which no longer reports success over a schema it did not
/// make whole; the schema dropped whole is named alone.
#[tokio::test]
async fn a_run_over_a_schema_dropped_in_part_names_what_is_missing() {
    let (_db, pool) = fresh_migrated_database(1, pgonce::migrate).await;
    let missing = async || match migrate::migrate(&pool).await {
        Err(MigrateError::Source(e)) => e
            .downcast::<migrate::SchemaMissing>()
            .map(|m| m.missing)
            .unwrap_or_else(|e| panic!("not SchemaMissing: {e}")),
        other => panic!("expected SchemaMissing, got {other:?}"),
    };
    sqlx::query("DROP TABLE pgonce.jobs CASCADE")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DROP FUNCTION pgonce.job_claim CASCADE")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(missing().await, ["pgonce.jobs", "pgonce.job_claim()"]);
    sqlx::query("DROP SCHEMA pgonce CASCADE")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(missing().await, ["schema pgonce"]);
}
