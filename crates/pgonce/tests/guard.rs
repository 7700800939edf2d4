//! The guarded write against a real PostgreSQL: the duplicate-incident race (a
//! message redelivered to a second worker, both read "no open incident", both
//! insert; steps T00-T10) with and without the guard, the re-read seeing the
//! previous lock holder's write, the conflict path writing nothing, hostile
//! keys, and the lock's release on commit, rollback and connection death.

mod support;

use pgonce::guard::{Guard, GuardConfig, ReadSet};
use pgonce::{Error, LockKey};
use pgonce_testkit::{Interleaving, Session, fresh_migrated_database};
use sqlx::{PgConnection, PgPool};
use tokio::sync::oneshot;

const SCHEMA: &str = "CREATE TABLE things (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                      entity text NOT NULL, open boolean NOT NULL DEFAULT true)";

async fn setup() -> (pgonce_testkit::ScratchDatabase, PgPool) {
    let (db, pool) = fresh_migrated_database(8, pgonce::migrate).await;
    sqlx::query(SCHEMA).execute(&pool).await.unwrap();
    (db, pool)
}

fn guard() -> Guard {
    Guard::new("things", GuardConfig::default()).unwrap()
}

/// [`guard`] at `isolation`.
fn guard_at(isolation: pgonce::guard::Isolation) -> Guard {
    Guard::new(
        "things",
        GuardConfig {
            isolation,
            ..GuardConfig::default()
        },
    )
    .unwrap()
}

async fn open_ids(conn: &mut PgConnection, entity: &str) -> pgonce::Result<ReadSet> {
    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM things WHERE entity = $1 AND open ORDER BY id")
            .bind(entity)
            .fetch_all(conn)
            .await?;
    Ok(ReadSet::from_ids(ids))
}

async fn insert(conn: &mut PgConnection, entity: &str) -> pgonce::Result<()> {
    sqlx::query("INSERT INTO things (entity) VALUES ($1)")
        .bind(entity)
        .execute(conn)
        .await?;
    Ok(())
}

async fn count_open(pool: &PgPool, entity: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM things WHERE entity = $1 AND open")
        .bind(entity)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// One guarded insert of `entity`, as a spawnable future.
async fn guarded_insert(
    pool: PgPool,
    namespace: &'static str,
    entity: String,
    seen: ReadSet,
) -> pgonce::Result<()> {
    let key = LockKey::new(namespace, &entity)?;
    guarded_insert_under(pool, key, entity, seen).await
}

/// [`guarded_insert`] under the lock `key`, whatever the entity.
async fn guarded_insert_under(
    pool: PgPool,
    key: LockKey,
    entity: String,
    seen: ReadSet,
) -> pgonce::Result<()> {
    guarded_insert_by(guard(), pool, key, entity, seen).await
}

/// [`guarded_insert_under`] by `guard`.
async fn guarded_insert_by(
    guard: Guard,
    pool: PgPool,
    key: LockKey,
    entity: String,
    seen: ReadSet,
) -> pgonce::Result<()> {
    guard
        .write(
            &pool,
            key,
            &seen,
            async |c| open_ids(c, &entity).await,
            async |c| insert(c, &entity).await,
        )
        .await
}

/// A guarded insert that, once inserted and still holding the lock, tells
/// `inserted` and waits for `go` before committing.
async fn paused_insert(
    pool: PgPool,
    namespace: &'static str,
    entity: String,
    seen: ReadSet,
    inserted: oneshot::Sender<()>,
    go: oneshot::Receiver<()>,
) -> pgonce::Result<()> {
    let key = LockKey::new(namespace, &entity)?;
    guard()
        .write(
            &pool,
            key,
            &seen,
            async |c| open_ids(c, &entity).await,
            async |c| {
                insert(c, &entity).await?;
                let _ = inserted.send(());
                let _ = go.await;
                Ok(())
            },
        )
        .await
}

#[tokio::test]
async fn duplicate_incident_t00_t10_without_a_guard_leaves_two_open() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (w1, w2) = (
        race.session("W1").await.unwrap(),
        race.session("W2").await.unwrap(),
    );
    let read = |p: PgPool| async move {
        let mut c = p.acquire().await?;
        open_ids(&mut c, "X").await
    };
    let seen1 = race
        .step(&w1, "T01 read", read(w1.pool().clone()))
        .await
        .unwrap()
        .unwrap();
    let seen2 = race
        .step(&w2, "T05 read", read(w2.pool().clone()))
        .await
        .unwrap()
        .unwrap();
    assert!(seen1.is_empty() && seen2.is_empty());
    for (w, what) in [(&w1, "T08 insert"), (&w2, "T10 insert")] {
        let p = w.pool().clone();
        race.step(w, what, async move {
            let mut c = p.acquire().await?;
            insert(&mut c, "X").await
        })
        .await
        .unwrap()
        .unwrap();
    }
    assert_eq!(count_open(&pool, "X").await, 2, "the duplicate incident");
}

#[tokio::test]
async fn duplicate_incident_t00_t10_with_the_guard_leaves_one_open_and_a_conflict() {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (w1, w2) = (
        race.session("W1").await.unwrap(),
        race.session("W2").await.unwrap(),
    );
    let g = guard();
    let seen1 = race
        .step(
            &w1,
            "T01 read",
            g.read(w1.pool(), async |c| open_ids(c, "X").await),
        )
        .await
        .unwrap()
        .unwrap();
    let free = tokio::time::timeout(std::time::Duration::from_secs(5), w1.pool().acquire()).await;
    assert!(free.is_ok(), "no connection held during evaluation");
    drop(free);
    let seen2 = race
        .step(
            &w2,
            "T05 read",
            g.read(w2.pool(), async |c| open_ids(c, "X").await),
        )
        .await
        .unwrap()
        .unwrap();
    race.step(
        &w1,
        "T08 guarded insert",
        guarded_insert(w1.pool().clone(), "e", "X".into(), seen1),
    )
    .await
    .unwrap()
    .unwrap();
    let second = race
        .step(
            &w2,
            "T10 guarded insert",
            guarded_insert(w2.pool().clone(), "e", "X".into(), seen2),
        )
        .await
        .unwrap();
    match second {
        Err(Error::Conflict {
            guard,
            expected,
            found,
        }) => {
            assert_eq!(guard, "things");
            assert!(expected.is_empty());
            assert_eq!(found.len(), 1);
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(count_open(&pool, "X").await, 1, "I1 held");
}

/// Writer W1's guarded insert of `entity` (lock key `e`/`entity`), run
/// until it has inserted and still holds the lock (its task keeps W1's
/// connection); W2 is the session for the writer that comes second.
struct FirstWriter {
    race: Interleaving,
    w2: Session,
    /// Lets W1 commit.
    go: oneshot::Sender<()>,
    /// W1's write, to be awaited once it may commit.
    first: tokio::task::JoinHandle<pgonce::Result<()>>,
}

async fn first_writer_inserted(db: &pgonce_testkit::ScratchDatabase, entity: &str) -> FirstWriter {
    let race = Interleaving::new(db.options()).await.unwrap();
    let (w1, w2) = (
        race.session("W1").await.unwrap(),
        race.session("W2").await.unwrap(),
    );
    let (inserted_tx, inserted) = oneshot::channel();
    let (go, go_rx) = oneshot::channel();
    let first = tokio::spawn(paused_insert(
        w1.pool().clone(),
        "e",
        entity.into(),
        ReadSet::new(),
        inserted_tx,
        go_rx,
    ));
    race.step(&w1, "lock, re-read, insert (not committed)", inserted)
        .await
        .unwrap()
        .unwrap();
    FirstWriter {
        race,
        w2,
        go,
        first,
    }
}

/// The write the re-read must see is committed while the second writer
/// waits for the lock: READ COMMITTED takes the re-read's snapshot after the
/// lock is granted, so the second writer conflicts instead of duplicating.
#[tokio::test]
async fn a_writer_waiting_for_the_lock_sees_the_previous_holders_insert() {
    let (db, pool) = setup().await;
    let writer = first_writer_inserted(&db, "X").await;
    let (race, w2) = (&writer.race, &writer.w2);
    let second = race
        .step_blocks(
            w2,
            "guarded insert",
            guarded_insert(w2.pool().clone(), "e", "X".into(), ReadSet::new()),
        )
        .await
        .unwrap();
    assert_eq!(second.blocked_by(), ["W1"]);
    writer.go.send(()).unwrap();
    writer.first.await.unwrap().unwrap();
    let outcome = second.resume().await.unwrap();
    assert!(
        matches!(outcome, Err(Error::Conflict { .. })),
        "{outcome:?}"
    );
    assert_eq!(count_open(&pool, "X").await, 1);
}

#[tokio::test]
async fn the_conflict_path_writes_nothing_and_never_runs_the_write() {
    let (_db, pool) = setup().await;
    let mut c = pool.acquire().await.unwrap();
    insert(&mut c, "X").await.unwrap();
    drop(c);
    let mut ran = false;
    let outcome = guard()
        .write(
            &pool,
            LockKey::new("e", "X").unwrap(),
            &ReadSet::new(),
            async |c| open_ids(c, "X").await,
            async |c| {
                ran = true;
                insert(c, "X").await
            },
        )
        .await;
    assert!(matches!(outcome, Err(Error::Conflict { .. })));
    assert!(!ran, "the write must not run on a conflict");
    assert_eq!(count_open(&pool, "X").await, 1);

    // A write that fails half-way rolls back what it did.
    let seen = guard()
        .read(&pool, async |c| open_ids(c, "X").await)
        .await
        .unwrap();
    let outcome: pgonce::Result<()> = guard()
        .write(
            &pool,
            LockKey::new("e", "X").unwrap(),
            &seen,
            async |c| open_ids(c, "X").await,
            async |c| {
                insert(c, "X").await?;
                sqlx::query("SELECT 1/0").execute(c).await?;
                Ok(())
            },
        )
        .await;
    assert!(matches!(outcome, Err(Error::Database(_))));
    assert_eq!(count_open(&pool, "X").await, 1, "nothing half-written");
}

#[tokio::test]
async fn versions_in_the_read_set_catch_an_update() {
    let (_db, pool) = setup().await;
    let mut c = pool.acquire().await.unwrap();
    insert(&mut c, "X").await.unwrap();
    drop(c);
    let versioned = async |c: &mut PgConnection| -> pgonce::Result<ReadSet> {
        #[derive(sqlx::FromRow)]
        struct Thing {
            id: i64,
            open: bool,
        }
        let rows: Vec<Thing> = sqlx::query_as("SELECT id, open FROM things ORDER BY id")
            .fetch_all(c)
            .await?;
        Ok(ReadSet::from_versions(
            rows.into_iter().map(|t| (t.id, t.open as i64)),
        ))
    };
    let seen = guard().read(&pool, versioned).await.unwrap();
    sqlx::query("UPDATE things SET open = false")
        .execute(&pool)
        .await
        .unwrap();
    let outcome = guard()
        .write(
            &pool,
            LockKey::new("e", "X").unwrap(),
            &seen,
            versioned,
            async |c| insert(c, "X").await,
        )
        .await;
    assert!(
        matches!(outcome, Err(Error::Conflict { .. })),
        "{outcome:?}"
    );
}

/// Two entities whose lock keys collide (a 64-bit key is a hash: two
/// entities may get the same one, or code computing its own keys may pick
/// one in use) share a lock, never a decision: the second writer waits for
/// the first, then re-reads its own entity's set and writes. A collision
/// costs a wait, not a conflict and not a duplicate.
#[tokio::test]
async fn two_entities_on_one_lock_key_wait_for_each_other_and_both_write() {
    let (db, pool) = setup().await;
    let writer = first_writer_inserted(&db, "A").await;
    let (race, w2) = (&writer.race, &writer.w2);
    let shared = LockKey::from_raw(LockKey::new("e", "A").unwrap().as_i64());
    let second = race
        .step_blocks(
            w2,
            "guarded insert of B under A's key",
            guarded_insert_under(w2.pool().clone(), shared, "B".into(), ReadSet::new()),
        )
        .await
        .unwrap();
    assert_eq!(second.blocked_by(), ["W1"]);
    writer.go.send(()).unwrap();
    writer.first.await.unwrap().unwrap();
    second.resume().await.unwrap().unwrap();
    assert_eq!(count_open(&pool, "A").await, 1);
    assert_eq!(count_open(&pool, "B").await, 1);
}

#[tokio::test]
async fn hostile_keys_work_and_never_share_a_lock_with_another_namespace() {
    let (db, pool) = setup().await;
    let long = "k".repeat(10_000);
    for hostile in [
        "it's a \"quote\"; DROP TABLE things; --".to_string(),
        "Zürich 🚨 \u{202e}ü".to_string(),
        long,
    ] {
        // Works end to end: the id set holds the hostile string too.
        guarded_insert(pool.clone(), "entity", hostile.clone(), ReadSet::new())
            .await
            .unwrap();
        assert_eq!(count_open(&pool, &hostile).await, 1);

        let race = Interleaving::new(db.options()).await.unwrap();
        let (a, b, c) = (
            race.session("A").await.unwrap(),
            race.session("B").await.unwrap(),
            race.session("C").await.unwrap(),
        );
        let (inserted_tx, inserted) = oneshot::channel();
        let (go, go_rx) = oneshot::channel();
        let seen = guard()
            .read(&pool, async |c| open_ids(c, &hostile).await)
            .await
            .unwrap();
        let holder = tokio::spawn(paused_insert(
            a.pool().clone(),
            "entity",
            hostile.clone(),
            seen.clone(),
            inserted_tx,
            go_rx,
        ));
        race.step(&a, "hold the lock", inserted)
            .await
            .unwrap()
            .unwrap();
        // Same key string, other namespace: does not wait.
        race.step(
            &b,
            "other namespace",
            guarded_insert(b.pool().clone(), "other", hostile.clone(), seen.clone()),
        )
        .await
        .unwrap()
        .unwrap();
        // Same namespace and key: waits for A.
        let waiting = race
            .step_blocks(
                &c,
                "same namespace",
                guarded_insert(c.pool().clone(), "entity", hostile.clone(), seen.clone()),
            )
            .await
            .unwrap();
        assert_eq!(waiting.blocked_by(), ["A"]);
        go.send(()).unwrap();
        holder.await.unwrap().unwrap();
        assert!(matches!(
            waiting.resume().await.unwrap(),
            Err(Error::Conflict { .. })
        ));
    }
}

async fn lock_is_free(pool: &PgPool, key: LockKey) -> bool {
    let mut tx = pool.begin().await.unwrap();
    let free = pgonce::lock::try_lock(&mut tx, key).await.unwrap();
    tx.rollback().await.unwrap();
    free
}

#[tokio::test]
async fn the_lock_is_released_on_commit_on_conflict_on_error_and_on_connection_death() {
    let (db, pool) = setup().await;
    let key = LockKey::new("e", "X").unwrap();

    guarded_insert(pool.clone(), "e", "X".into(), ReadSet::new())
        .await
        .unwrap();
    assert!(lock_is_free(&pool, key).await, "released by COMMIT");

    let conflict = guarded_insert(pool.clone(), "e", "X".into(), ReadSet::new()).await;
    assert!(matches!(conflict, Err(Error::Conflict { .. })));
    assert!(
        lock_is_free(&pool, key).await,
        "released by the conflict's ROLLBACK"
    );

    let failed: pgonce::Result<()> = guard()
        .write(
            &pool,
            key,
            &ReadSet::from_ids([1]),
            async |c| open_ids(c, "X").await,
            async |c| {
                sqlx::query("SELECT 1/0").execute(c).await?;
                Ok(())
            },
        )
        .await;
    assert!(matches!(failed, Err(Error::Database(_))));
    assert!(
        lock_is_free(&pool, key).await,
        "released by the error's ROLLBACK"
    );

    // A worker killed while it holds the lock: its backend dies, the lock
    // goes with it, and the waiter proceeds.
    let race = Interleaving::new(db.options()).await.unwrap();
    let (w1, w2) = (
        race.session("W1").await.unwrap(),
        race.session("W2").await.unwrap(),
    );
    let (inserted_tx, inserted) = oneshot::channel();
    let (_go, go_rx) = oneshot::channel::<()>();
    let seen = ReadSet::from_ids([1]);
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(w1.pool())
        .await
        .unwrap();
    let holder = tokio::spawn(paused_insert(
        w1.pool().clone(),
        "e",
        "X".into(),
        seen.clone(),
        inserted_tx,
        go_rx,
    ));
    race.step(&w1, "hold the lock", inserted)
        .await
        .unwrap()
        .unwrap();
    let waiting = race
        .step_blocks(
            &w2,
            "guarded insert",
            guarded_insert(w2.pool().clone(), "e", "X".into(), seen),
        )
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&pool)
        .await
        .unwrap();
    waiting.resume().await.unwrap().unwrap();
    holder.abort();
    assert_eq!(
        count_open(&pool, "X").await,
        2,
        "W1's insert died with it; W2's stands"
    );
    assert!(lock_is_free(&pool, key).await);
}

/// Counts `pgonce_guard_conflicts_total` by its `guard` label.
#[derive(Default)]
struct ConflictCounter(
    std::sync::Mutex<Vec<(String, std::sync::Arc<std::sync::atomic::AtomicU64>)>>,
);

impl ConflictCounter {
    /// The counter to record `key` into: a cell of its own for each
    /// `pgonce_guard_conflicts_total`, none for the rest.
    fn register(&self, key: &metrics::Key) -> metrics::Counter {
        if key.name() != "pgonce_guard_conflicts_total" {
            return metrics::Counter::noop();
        }
        let label = key
            .labels()
            .find(|l| l.key() == "guard")
            .map(|l| l.value().to_string())
            .unwrap_or_default();
        let cell = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        self.0.lock().unwrap().push((label, cell.clone()));
        metrics::Counter::from_arc(cell)
    }

    fn total(&self, guard: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(g, _)| g == guard)
            .map(|(_, c)| c.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }
}

/// The test runtime is single-threaded, so a thread-local recorder sees
/// every increment the guard makes.
#[tokio::test(flavor = "current_thread")]
async fn conflicts_are_counted_by_guard_name_and_successes_are_not() {
    let counter = ConflictCounter::default();
    let recorder = support::OnCounter(|key: &metrics::Key| counter.register(key));
    let _local = metrics::set_default_local_recorder(&recorder);
    let (_db, pool) = setup().await;
    guarded_insert(pool.clone(), "e", "X".into(), ReadSet::new())
        .await
        .unwrap();
    assert_eq!(counter.total("things"), 0);
    for _ in 0..2 {
        let outcome = guarded_insert(pool.clone(), "e", "X".into(), ReadSet::new()).await;
        assert!(matches!(outcome, Err(Error::Conflict { .. })));
    }
    assert_eq!(counter.total("things"), 2);
}

/// A guarded transaction opened by `Guard::begin` carries the caller's other
/// writes: after a passed check they commit together; after a failed check
/// nothing is written, and a dropped transaction releases the lock.
#[tokio::test]
async fn a_guarded_transaction_commits_the_callers_writes_only_after_a_passed_check() {
    let (_db, pool) = setup().await;
    let key = LockKey::new("test.things", "e1").unwrap();
    let seen = guard()
        .read(&pool, async |c| open_ids(c, "e1").await)
        .await
        .unwrap();

    let mut tx = guard().begin(&pool).await.unwrap();
    tx.check(key, &seen, async |c| open_ids(c, "e1").await)
        .await
        .unwrap();
    insert(&mut tx, "e1").await.unwrap();
    insert(&mut tx, "e1-sibling").await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count_open(&pool, "e1").await, 1);
    assert_eq!(count_open(&pool, "e1-sibling").await, 1);

    // The same stale decision again: the check refuses it.
    let mut tx = guard().begin(&pool).await.unwrap();
    let refused = tx
        .check(key, &seen, async |c| open_ids(c, "e1").await)
        .await;
    assert!(
        matches!(refused, Err(Error::Conflict { .. })),
        "{refused:?}"
    );
    tx.rollback().await.unwrap();
    assert_eq!(count_open(&pool, "e1").await, 1);

    // The lock is gone: another session takes it at once.
    let mut other = pool.begin().await.unwrap();
    assert!(pgonce::lock::try_lock(&mut other, key).await.unwrap());
}

/// `Guard::begin` opens the guarded transaction at READ COMMITTED, but
/// until its first statement the caller may still change the level
/// (`SET TRANSACTION ISOLATION LEVEL REPEATABLE READ`, through the
/// transaction it dereferences to). The check's lock statement then took
/// the transaction's snapshot before its wait, the re-read saw the state
/// from before the previous holder's insert, and a second OPEN row went
/// in: the duplicate the guard exists to prevent. The check must refuse
/// that transaction with a typed error instead, and nothing be written.
#[tokio::test]
async fn a_guarded_transaction_switched_to_repeatable_read_is_refused_not_a_duplicate() {
    // The check's lock waits as long as it takes, or for a bound: two
    // statements, each of which must tell.
    let bounded = GuardConfig {
        lock_timeout: Some(std::time::Duration::from_secs(600)),
        ..GuardConfig::default()
    };
    for (entity, config) in [("X", GuardConfig::default()), ("Y", bounded)] {
        switched_to_repeatable_read(entity, config).await;
    }
}

async fn switched_to_repeatable_read(entity: &'static str, config: GuardConfig) {
    let (db, pool) = setup().await;
    let writer = first_writer_inserted(&db, entity).await;
    let (race, w2) = (&writer.race, &writer.w2);
    let pool2 = w2.pool().clone();
    let checked = race
        .step_blocks(w2, "BEGIN, SET TRANSACTION, check", async move {
            let guard = Guard::new("things", config)?;
            let mut tx = guard.begin(&pool2).await?;
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                .execute(&mut **tx)
                .await?;
            let key = LockKey::new("e", entity)?;
            let out = tx
                .check(key, &ReadSet::new(), async |c| open_ids(c, entity).await)
                .await;
            if out.is_ok() {
                insert(&mut tx, entity).await?;
                tx.commit().await?;
            }
            out
        })
        .await
        .unwrap();
    assert_eq!(checked.blocked_by(), ["W1"]);
    writer.go.send(()).unwrap();
    writer.first.await.unwrap().unwrap();
    let outcome = checked.resume().await.unwrap();
    assert!(
        matches!(&outcome, Err(Error::WrongIsolation { found, .. }) if found == "repeatable read"),
        "{entity}: {outcome:?}"
    );
    assert_eq!(count_open(&pool, entity).await, 1);
}

/// Whether the one connection of `pool` is outside any transaction and
/// holds no advisory lock: what a pooled connection must look like between
/// uses. (`statement_timestamp() = transaction_timestamp()` only when this
/// statement started its own transaction; a simple query, so both are the
/// time its one message arrived.)
async fn clean_between_uses(pool: &PgPool) -> (bool, i64) {
    use sqlx::Row;
    let row = sqlx::raw_sql(
        "SELECT statement_timestamp() = transaction_timestamp(), \
         (SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    (row.get(0), row.get(1))
}

/// BEGIN and the lock travel in one message (`Guard::begin_for`). A guarded
/// write dropped while it waits for the lock must not leave its connection
/// in the pool inside a transaction holding the lock: the next user of the
/// connection would run in it and keep the lock.
#[tokio::test]
async fn a_write_dropped_while_waiting_for_the_lock_leaves_no_transaction_behind() {
    let (db, pool) = setup().await;
    let key = LockKey::new("e", "cancel").unwrap();
    let race = Interleaving::new(db.options()).await.unwrap();
    let (h, w) = (
        race.session("H").await.unwrap(),
        race.session("W").await.unwrap(),
    );
    let mut holder = h.pool().begin().await.unwrap();
    race.step(&h, "lock", pgonce::lock::lock(&mut holder, key))
        .await
        .unwrap()
        .unwrap();

    let writer = tokio::spawn(guarded_insert(
        w.pool().clone(),
        "e",
        "cancel".into(),
        ReadSet::new(),
    ));
    race.wait_until_blocked(&w, "guarded insert").await.unwrap();
    writer.abort();
    assert!(writer.await.unwrap_err().is_cancelled());
    race.note(&w, "dropped while waiting");
    race.step(&h, "COMMIT", holder.commit())
        .await
        .unwrap()
        .unwrap();

    // W's only connection, once it is back in the pool.
    assert_eq!(
        race.step(&w, "next use", clean_between_uses(w.pool()))
            .await
            .unwrap(),
        (true, 0),
        "outside any transaction, no lock held"
    );
    assert_eq!(count_open(&pool, "cancel").await, 0, "nothing written");
    assert!(lock_is_free(&pool, key).await);
}

/// Sessions H (to hold a lock) and W (to wait for it), W with its own
/// session-level `lock_timeout`, as a role's or database's setting gives
/// every new session.
async fn holder_and_waiter(
    db: &pgonce_testkit::ScratchDatabase,
    w_lock_timeout: &str,
) -> (Interleaving, Session, Session) {
    let race = Interleaving::new(db.options()).await.unwrap();
    let (h, w) = (
        race.session("H").await.unwrap(),
        race.session("W").await.unwrap(),
    );
    w.set("lock_timeout", w_lock_timeout).await.unwrap();
    (race, h, w)
}

/// With a lock timeout, BEGIN and the lock still travel together; a timeout
/// is a typed error, leaves the connection outside any transaction with its
/// own lock_timeout, and a later write goes through.
#[tokio::test]
async fn a_lock_timeout_is_typed_and_leaves_the_connection_clean() {
    let (db, pool) = setup().await;
    let key = LockKey::new("e", "timeout").unwrap();
    let guard = Guard::new(
        "things",
        GuardConfig {
            lock_timeout: Some(std::time::Duration::from_millis(50)),
            ..GuardConfig::default()
        },
    )
    .unwrap();
    let (race, h, w) = holder_and_waiter(&db, "7s").await;
    let mut holder = h.pool().begin().await.unwrap();
    pgonce::lock::lock(&mut holder, key).await.unwrap();

    let write = |pool: PgPool| {
        guarded_insert_by(guard.clone(), pool, key, "timeout".into(), ReadSet::new())
    };
    let timed_out = race
        .step(&w, "guarded insert", write(w.pool().clone()))
        .await
        .unwrap();
    assert!(
        matches!(timed_out, Err(Error::LockTimeout { key: k, .. }) if k == key),
        "{timed_out:?}"
    );
    assert_eq!(clean_between_uses(w.pool()).await, (true, 0));
    let setting: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(w.pool())
        .await
        .unwrap();
    assert_eq!(setting, "7s", "the session's own lock_timeout");

    holder.commit().await.unwrap();
    // Inside the guarded transaction the caller's writes run with the
    // session's lock_timeout, not the guard's.
    let mut tx = guard.begin_for(w.pool(), key).await.unwrap();
    let setting: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut **tx)
        .await
        .unwrap();
    assert_eq!(setting, "7s");
    tx.check(key, &ReadSet::new(), async |c| open_ids(c, "timeout").await)
        .await
        .unwrap();
    insert(&mut tx, "timeout").await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count_open(&pool, "timeout").await, 1);
}

/// The guarded transaction runs at the level the guard was configured with,
/// whatever the database's default: BEGIN and the lock travel in one
/// message, and the level set before the lock must survive the BEGIN.
#[tokio::test]
async fn the_guarded_transaction_runs_at_the_configured_level_whatever_the_default() {
    let (db, pool) = setup().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{}\" SET default_transaction_isolation = 'repeatable read'",
        db.name()
    )))
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let pool = PgPool::connect_with(db.options()).await.unwrap();
    let default: String = sqlx::query_scalar("SELECT current_setting('transaction_isolation')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(default, "repeatable read");
    let key = LockKey::new("things", "level").unwrap();
    for (isolation, expected) in [
        (pgonce::guard::Isolation::ReadCommitted, "read committed"),
        (pgonce::guard::Isolation::Serializable, "serializable"),
    ] {
        let guard = guard_at(isolation);
        for timeout in [None, Some(std::time::Duration::from_secs(5))] {
            let guard = Guard::new(
                "things",
                GuardConfig {
                    lock_timeout: timeout,
                    ..guard.config().clone()
                },
            )
            .unwrap();
            let mut opened = [
                guard.begin_for(&pool, key).await.unwrap(),
                guard.begin(&pool).await.unwrap(),
            ];
            for tx in &mut opened {
                let level: String =
                    sqlx::query_scalar("SELECT current_setting('transaction_isolation')")
                        .fetch_one(&mut ***tx)
                        .await
                        .unwrap();
                assert_eq!(level, expected, "{isolation:?} {timeout:?}");
            }
            for tx in opened {
                tx.rollback().await.unwrap();
            }
        }
    }
}

/// A guard without a lock_timeout waits for its lock as long as it takes,
/// as its config says, whatever lock_timeout the session inherited (an
/// operator's `ALTER ROLE ... SET lock_timeout`; here set on the session):
/// the guarded write, and the check of a key taken after BEGIN, are still
/// waiting at four times that timeout, and go through once the holder
/// commits. Inheriting it, the write failed after 50 ms as
/// `LockTimeout { waited: 0ns }`.
#[tokio::test]
async fn a_guard_without_a_lock_timeout_waits_past_the_sessions_own() {
    let (db, pool) = setup().await;
    let key = LockKey::new("e", "inherited").unwrap();
    let (race, h, w) = holder_and_waiter(&db, "50ms").await;

    let mut holder = h.pool().begin().await.unwrap();
    race.step(&h, "lock", pgonce::lock::lock(&mut holder, key))
        .await
        .unwrap()
        .unwrap();
    let write = race
        .step_blocks(
            &w,
            "guarded insert",
            guarded_insert(w.pool().clone(), "e", "inherited".into(), ReadSet::new()),
        )
        .await
        .unwrap();
    write
        .outlasts_then_commit(200, &h, holder)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(count_open(&pool, "inherited").await, 1);

    let mut holder = h.pool().begin().await.unwrap();
    race.step(&h, "lock", pgonce::lock::lock(&mut holder, key))
        .await
        .unwrap()
        .unwrap();
    let seen = guard()
        .read(&pool, async |c| open_ids(c, "inherited").await)
        .await
        .unwrap();
    let pool_w = w.pool().clone();
    let check = race
        .step_blocks(&w, "check", async move {
            let mut tx = guard().begin(&pool_w).await?;
            tx.check(key, &seen, async |c| open_ids(c, "inherited").await)
                .await?;
            tx.rollback().await
        })
        .await
        .unwrap();
    check
        .outlasts_then_commit(200, &h, holder)
        .await
        .unwrap()
        .unwrap();
}

/// `statement_timeout` still bounds the guard's wait, as the module docs
/// say: a guarded write waiting for its lock fails once it runs out with
/// the typed `QueryCanceled` (SQLSTATE 57014), not `LockTimeout` nor a bare
/// database error, writes nothing,
/// and leaves its connection outside any transaction (the next write on
/// that one connection goes through).
#[tokio::test]
async fn statement_timeout_still_bounds_the_guards_wait() {
    let (db, pool) = setup().await;
    let key = LockKey::new("e", "statement timeout").unwrap();
    let (race, h, w) = holder_and_waiter(&db, "0").await;
    w.set("statement_timeout", "2s").await.unwrap();
    let mut holder = h.pool().begin().await.unwrap();
    pgonce::lock::lock(&mut holder, key).await.unwrap();

    let insert = || {
        guarded_insert(
            w.pool().clone(),
            "e",
            "statement timeout".into(),
            ReadSet::new(),
        )
    };
    let timeout = ("statement_timeout", std::time::Duration::from_secs(2));
    let waited =
        support::outcome_of_blocked_wait(&race, &w, "H", "guarded insert", timeout, insert).await;
    let Err(Error::QueryCanceled { message }) = &waited else {
        panic!("{waited:?}");
    };
    assert!(message.contains("statement timeout"), "{message}");
    holder.commit().await.unwrap();
    assert_eq!(count_open(&pool, "statement timeout").await, 0);
    insert().await.unwrap();
    assert_eq!(count_open(&pool, "statement timeout").await, 1);
}

/// What a guarded write of `X` decided on "nothing open" (a guard at
/// `isolation`) returns when it has waited for W1: a writer holding X's
/// key with `pgonce::lock` in a transaction of its own at the same level,
/// which inserts an open X (reading X's open set first if `reads_first`)
/// and commits while the guarded write waits. And how many X are open
/// after.
async fn guarded_write_after_a_lock_holder(
    isolation: pgonce::guard::Isolation,
    reads_first: bool,
) -> (pgonce::Result<()>, i64) {
    let (db, pool) = setup().await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let (w1, w2) = (
        race.session("W1").await.unwrap(),
        race.session("W2").await.unwrap(),
    );
    let key = LockKey::new("e", "X").unwrap();
    let level = match isolation {
        pgonce::guard::Isolation::Serializable => pgonce::IsolationLevel::Serializable,
        _ => pgonce::IsolationLevel::ReadCommitted,
    };
    let mut holder = pgonce::begin(w1.pool(), level).await.unwrap();
    race.step(&w1, "lock", pgonce::lock::lock(&mut holder, key))
        .await
        .unwrap()
        .unwrap();
    if reads_first {
        let open = race
            .step(&w1, "read X", open_ids(&mut holder, "X"))
            .await
            .unwrap()
            .unwrap();
        assert!(open.is_empty());
    }
    race.step(&w1, "insert X", insert(&mut holder, "X"))
        .await
        .unwrap()
        .unwrap();
    let write = race
        .step_blocks(
            &w2,
            "guarded insert",
            guarded_insert_by(
                guard_at(isolation),
                w2.pool().clone(),
                key,
                "X".into(),
                ReadSet::new(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(write.blocked_by(), ["W1"]);
    race.step(&w1, "COMMIT", holder.commit())
        .await
        .unwrap()
        .unwrap();
    let outcome = write.resume().await.unwrap();
    (outcome, count_open(&pool, "X").await)
}

/// Under SERIALIZABLE the guarded write's snapshot is taken by its lock
/// statement, before the wait: the re-read misses what the writer it
/// waited for committed. PostgreSQL aborts the write only if that writer
/// read the set it changed (the two conflicts form a cycle); one that
/// inserts without reading conflicts one way only, SERIALIZABLE orders the
/// guarded write before it, and the stale re-read lets a second open X
/// through. At READ COMMITTED the same writer is seen: a conflict. (Found
/// by the guard model; the module docs state the requirement.)
#[tokio::test]
async fn under_serializable_only_a_writer_that_reads_the_set_stops_a_waiting_guarded_write() {
    use pgonce::guard::Isolation::{ReadCommitted, Serializable};

    let (outcome, open) = guarded_write_after_a_lock_holder(ReadCommitted, false).await;
    assert!(
        matches!(outcome, Err(Error::Conflict { .. })),
        "{outcome:?}"
    );
    assert_eq!(open, 1);

    let (outcome, open) = guarded_write_after_a_lock_holder(Serializable, true).await;
    assert!(
        matches!(&outcome, Err(Error::SerializationFailure { sqlstate, .. }) if sqlstate == "40001"),
        "{outcome:?}"
    );
    assert_eq!(open, 1);

    let (outcome, open) = guarded_write_after_a_lock_holder(Serializable, false).await;
    assert!(outcome.is_ok(), "{outcome:?}");
    assert_eq!(open, 2, "the holder's insert, unread, and the guarded one");
}
