//! Per-scope gapless sequences (I2) against a real PostgreSQL: unique and
//! gapless under concurrency, rollback frees the number, scopes independent
//! (shown step by step), the declaration's other work atomic with its
//! number, and the wrong isolation level a typed error, never a duplicate.

mod support;

use std::collections::BTreeMap;

use pgonce::IsolationLevel;
use pgonce::{Error, NumberedTable, Sequence, SequenceConfig, SequenceStrategy as Strategy};
use pgonce_testkit::{Interleaving, Session, fresh_migrated_database};
use sqlx::{PgConnection, PgPool};
use support::incompressible;

// Tables go to `public` explicitly: the test role is called `pgonce`, so
// with the default search_path ("$user", public) an unqualified CREATE
// TABLE would land in the `pgonce` schema.
const SCHEMA: &str = "
CREATE TABLE public.incidents (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org    text   NOT NULL,
    number bigint NOT NULL,
    UNIQUE (org, number)
);
CREATE TABLE public.declaration_work (org text NOT NULL, note text NOT NULL);
";

async fn setup(max: u32) -> (PgPool, pgonce_testkit::ScratchDatabase) {
    let (db, pool) = fresh_migrated_database(max, pgonce::migrate).await;
    sqlx::raw_sql(SCHEMA).execute(&pool).await.unwrap();
    (pool, db)
}

fn sequence(strategy: Strategy) -> Sequence {
    Sequence::new(
        NumberedTable::new("incidents", "org", "number").unwrap(),
        SequenceConfig { strategy },
    )
    .unwrap()
}

/// A sequence of `strategy` over `table`'s (`org`, `n`).
fn sequence_over(table: &str, strategy: Strategy) -> Sequence {
    Sequence::new(
        NumberedTable::new(table, "org", "n").unwrap(),
        SequenceConfig { strategy },
    )
    .unwrap()
}

/// `seq`'s next number of `scope` in a transaction of its own, rolled back.
async fn take_and_roll_back(seq: &Sequence, pool: &PgPool, scope: &str) -> pgonce::Result<i64> {
    let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
    let taken = seq.next(&mut tx, &scope).await.map(|taken| taken.number);
    tx.rollback().await?;
    taken
}

async fn insert_incident(conn: &mut PgConnection, org: &str, number: i64) -> pgonce::Result<()> {
    sqlx::query("INSERT INTO incidents (org, number) VALUES ($1, $2)")
        .bind(org)
        .bind(number)
        .execute(conn)
        .await?;
    Ok(())
}

/// A whole declaration: other work first, the number last, one commit.
async fn declare(seq: &Sequence, pool: &PgPool, org: &str) -> pgonce::Result<i64> {
    let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
    sqlx::query("INSERT INTO declaration_work (org, note) VALUES ($1, 'paged the on-call')")
        .bind(org)
        .execute(&mut *tx)
        .await?;
    let declared = seq
        .commit_numbered(tx, &org, async |conn: &mut PgConnection, number| {
            insert_incident(conn, org, number).await
        })
        .await?;
    Ok(declared.number)
}

/// Locks a strategy takes on a scope (advisory, or a table in EXCLUSIVE
/// mode) that `conn`'s own backend holds.
async fn scope_locks_held(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() \
         AND (locktype = 'advisory' OR mode = 'ExclusiveLock' AND locktype = 'relation')",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Numbers per scope, as committed.
async fn committed(pool: &PgPool) -> BTreeMap<String, Vec<i64>> {
    #[derive(sqlx::FromRow)]
    struct Numbered {
        org: String,
        number: i64,
    }
    let rows: Vec<Numbered> =
        sqlx::query_as("SELECT org, number FROM incidents ORDER BY org, number")
            .fetch_all(pool)
            .await
            .unwrap();
    let mut map: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for Numbered { org, number } in rows {
        map.entry(org).or_default().push(number);
    }
    map
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn numbers_are_unique_and_gapless_under_concurrency_with_rollbacks() {
    for strategy in [
        Strategy::AdvisoryLock,
        Strategy::CounterRow,
        Strategy::TableLock,
    ] {
        let (pool, _db) = setup(20).await;
        let seq = sequence(strategy);
        let mut tasks = Vec::new();
        for worker in 0..12usize {
            let (seq, pool) = (seq.clone(), pool.clone());
            tasks.push(tokio::spawn(async move {
                let org = format!("org-{}", worker % 3);
                let mut kept = 0usize;
                for i in 0..8usize {
                    let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
                        .await
                        .unwrap();
                    let taken = seq.next(&mut tx, &org).await.unwrap();
                    insert_incident(&mut tx, &org, taken.number).await.unwrap();
                    // Every third declaration fails late and rolls back.
                    if (worker + i) % 3 == 0 {
                        tx.rollback().await.unwrap();
                    } else {
                        tx.commit().await.unwrap();
                        kept += 1;
                    }
                }
                kept
            }));
        }
        let mut kept = 0;
        for t in tasks {
            kept += t.await.unwrap();
        }
        let numbers = committed(&pool).await;
        assert_eq!(numbers.len(), 3, "{strategy}");
        assert_eq!(numbers.values().map(Vec::len).sum::<usize>(), kept);
        for (org, ns) in numbers {
            let expected: Vec<i64> = (1..=ns.len() as i64).collect();
            assert_eq!(ns, expected, "{strategy}: {org} is not 1..n");
        }
    }
}

#[tokio::test]
async fn a_rolled_back_declaration_frees_its_number() {
    for strategy in Strategy::ALL {
        let (pool, _db) = setup(4).await;
        let seq = sequence(strategy);
        assert_eq!(declare(&seq, &pool, "acme").await.unwrap(), 1);

        let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        let taken = seq.next(&mut tx, &"acme").await.unwrap();
        assert_eq!(taken.number, 2);
        insert_incident(&mut tx, "acme", 2).await.unwrap();
        tx.rollback().await.unwrap();

        assert_eq!(
            declare(&seq, &pool, "acme").await.unwrap(),
            2,
            "{strategy}: the rolled-back number is handed out again"
        );
        assert_eq!(committed(&pool).await["acme"], [1, 2]);
    }
}

/// A whole declaration in acme on `session`, seen blocked.
async fn declaring_acme_blocks(
    race: &Interleaving,
    session: &Session,
    seq: &Sequence,
    strategy: Strategy,
) -> pgonce_testkit::Blocked<pgonce::Result<i64>> {
    let (seq, pool) = (seq.clone(), session.pool().clone());
    race.step_blocks(session, "declare(acme)", async move {
        declare(&seq, &pool, "acme").await
    })
    .await
    .unwrap_or_else(|e| panic!("{strategy}: {e}"))
}

/// Holds scope `acme` in session A, then shows that a declarer of `globex`
/// runs to completion meanwhile, and one of `acme` waits for A.
async fn other_scope_runs_same_scope_waits(strategy: Strategy) {
    let (pool, db) = setup(4).await;
    let seq = sequence(strategy);
    // Scopes that already have rows, so select-for-update has rows to lock.
    declare(&seq, &pool, "acme").await.unwrap();
    declare(&seq, &pool, "globex").await.unwrap();

    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let c = race.session("C").await.unwrap();

    let mut tx_a = race
        .step(
            &a,
            "BEGIN",
            pgonce::begin(a.pool(), IsolationLevel::ReadCommitted),
        )
        .await
        .unwrap()
        .unwrap();
    let taken = race
        .step(&a, "next(acme)", seq.next(&mut tx_a, &"acme"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(taken.number, 2);
    insert_incident(&mut tx_a, "acme", 2).await.unwrap();

    // Another organization: completes while A holds acme.
    let globex = race
        .step(&c, "declare(globex)", declare(&seq, c.pool(), "globex"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(globex, 2, "{strategy}");
    assert!(
        race.blockers_of(&c).await.unwrap().is_none(),
        "{strategy}: C never waited"
    );

    // The same organization: waits for A, then gets the next number.
    let waiting = declaring_acme_blocks(&race, &b, &seq, strategy).await;
    assert_eq!(waiting.blocked_by(), ["A"], "{strategy}");
    race.step(&a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(waiting.resume().await.unwrap().unwrap(), 3, "{strategy}");
    assert_eq!(committed(&pool).await["acme"], [1, 2, 3]);
}

#[tokio::test]
async fn a_declarer_in_another_scope_does_not_wait_under_the_advisory_lock() {
    other_scope_runs_same_scope_waits(Strategy::AdvisoryLock).await;
}

#[tokio::test]
async fn a_declarer_in_another_scope_does_not_wait_under_the_counter_row() {
    other_scope_runs_same_scope_waits(Strategy::CounterRow).await;
}

/// A declaration waits for its scope's lock as long as it takes, whatever
/// lock_timeout the session inherited (an operator's `ALTER ROLE ... SET
/// lock_timeout`; here set on the session): under each strategy, it is
/// still waiting at four times that timeout and gets the next number once
/// the holder commits, and the statements after the take run with the
/// session's value again. Inheriting it, the declaration failed after
/// 50 ms with PostgreSQL's 55P03 as a database error.
#[tokio::test]
async fn a_declaration_waits_for_its_scope_past_the_sessions_lock_timeout() {
    let (pool, db) = setup(4).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let w = race.session("W").await.unwrap();
    w.set("lock_timeout", "50ms").await.unwrap();
    let strategies = [
        Strategy::AdvisoryLock,
        Strategy::TableLock,
        Strategy::SelectForUpdate,
        Strategy::CounterRow,
    ];
    // A row in the scope, so select-for-update has one to lock.
    declare(&sequence(Strategy::AdvisoryLock), &pool, "acme")
        .await
        .unwrap();
    for strategy in strategies {
        let seq = sequence(strategy);
        let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        let taken = race
            .step(&a, "next(acme)", seq.next(&mut tx_a, &"acme"))
            .await
            .unwrap()
            .unwrap();
        insert_incident(&mut tx_a, "acme", taken.number)
            .await
            .unwrap();
        let waiting = declaring_acme_blocks(&race, &w, &seq, strategy).await;
        let number = waiting
            .outlasts_then_commit(200, &a, tx_a)
            .await
            .unwrap_or_else(|e| panic!("{strategy}: {e}"))
            .unwrap();
        assert_eq!(number, taken.number + 1, "{strategy}");
    }
    for strategy in strategies {
        let mut tx = pgonce::begin(w.pool(), IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        sequence(strategy).next(&mut tx, &"acme").await.unwrap();
        let after: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(after, "50ms", "{strategy}");
    }
}

#[tokio::test]
async fn under_the_table_lock_a_declarer_in_another_scope_waits_too() {
    let (pool, db) = setup(4).await;
    let seq = sequence(Strategy::TableLock);
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let c = race.session("C").await.unwrap();
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    seq.next(&mut tx_a, &"acme").await.unwrap();

    let (seq_c, pool_c) = (seq.clone(), c.pool().clone());
    let waiting = race
        .step_blocks(&c, "declare(globex)", async move {
            declare(&seq_c, &pool_c, "globex").await
        })
        .await
        .expect("the baseline blocks every scope");
    assert_eq!(waiting.blocked_by(), ["A"]);
    tx_a.rollback().await.unwrap();
    assert_eq!(waiting.resume().await.unwrap().unwrap(), 1);
    assert_eq!(committed(&pool).await["globex"], [1]);
}

/// A declaration given up while it waits for its scope (its future
/// dropped, as when a client goes away) leaves nothing behind: its
/// statement still waits on the server, takes the scope once the holder
/// commits, and is rolled back before its connection is used again, so
/// the connection comes back to the pool outside any transaction, holding
/// no lock; its other work is not committed; and the next declaration
/// gets the next number, no gap.
#[tokio::test]
async fn a_declaration_dropped_while_it_waits_leaves_no_lock_no_work_and_no_gap() {
    for strategy in [
        Strategy::AdvisoryLock,
        Strategy::CounterRow,
        Strategy::TableLock,
    ] {
        let (pool, db) = setup(4).await;
        let seq = sequence(strategy);
        let (race, tx_a, b) = a_holds_acme(&db, &seq).await;
        let waiting = declaring_acme_blocks(&race, &b, &seq, strategy).await;
        assert_eq!(waiting.blocked_by(), ["A"], "{strategy}");
        waiting.cancel();
        tx_a.commit().await.unwrap();
        // B's one connection, once it is back in its pool.
        let mut conn = b.pool().acquire().await.unwrap();
        let in_transaction: bool =
            sqlx::raw_sql("SELECT statement_timestamp() <> transaction_timestamp()")
                .fetch_one(&mut *conn)
                .await
                .map(|row| sqlx::Row::get(&row, 0))
                .unwrap();
        assert!(
            !in_transaction,
            "{strategy}: B's connection is in a transaction"
        );
        assert_eq!(scope_locks_held(&mut conn).await, 0, "{strategy}");
        drop(conn);
        assert_eq!(declare(&seq, &pool, "acme").await.unwrap(), 2, "{strategy}");
        assert_eq!(committed(&pool).await["acme"], [1, 2], "{strategy}");
        let work: i64 =
            sqlx::query_scalar("SELECT count(*) FROM declaration_work WHERE org = 'acme'")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(work, 1, "{strategy}: only the last declaration's work");
    }
}

/// Session A has taken and inserted acme's first number, uncommitted;
/// session B is ready.
async fn a_holds_acme(
    db: &pgonce_testkit::ScratchDatabase,
    seq: &Sequence,
) -> (
    Interleaving,
    sqlx::Transaction<'static, sqlx::Postgres>,
    Session,
) {
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    let taken = seq.next(&mut tx_a, &"acme").await.unwrap();
    insert_incident(&mut tx_a, "acme", taken.number)
        .await
        .unwrap();
    (race, tx_a, b)
}

#[tokio::test]
async fn select_for_update_lets_the_first_declarations_of_a_scope_collide_and_the_index_rejects_one()
 {
    let (pool, db) = setup(4).await;
    let seq = sequence(Strategy::SelectForUpdate);
    let (race, tx_a, b) = a_holds_acme(&db, &seq).await;

    // B locks no row (there is none), computes 1 as well, and its INSERT
    // waits on A's uncommitted index entry.
    let (seq_b, pool_b) = (seq.clone(), b.pool().clone());
    let waiting = race
        .step_blocks(&b, "declare(acme)", async move {
            declare(&seq_b, &pool_b, "acme").await
        })
        .await
        .unwrap();
    tx_a.commit().await.unwrap();
    let err = waiting.resume().await.unwrap().unwrap_err();
    assert!(
        matches!(&err, Error::NumberTaken { number: 1, scope, .. } if scope == "acme"),
        "{err}"
    );
    assert_eq!(committed(&pool).await["acme"], [1], "no duplicate stored");
}

/// Under select-for-update two declarers waiting for the same scope queue
/// one behind the other, whatever plan each one's lock query gets: the
/// scope's rows are locked in number order. Driven with a scope whose rows
/// lie in the heap in another order than their numbers (2 before 1), one
/// waiter planned as a sequential scan and the other as an index scan.
/// (Each locked in its plan's order: A waited at row 2, B at row 1, and
/// once the holder ended each locked its first row and waited for the
/// other's: a deadlock, one of them aborted. The plan changes with the
/// statistics, as when autovacuum first analyzes the table.)
#[tokio::test]
async fn select_for_update_waiters_queue_whatever_their_plans_never_deadlock() {
    let (pool, db) = setup(4).await;
    let seq = sequence(Strategy::SelectForUpdate);
    sqlx::query("INSERT INTO incidents (org, number) VALUES ('acme', 2), ('acme', 1)")
        .execute(&pool)
        .await
        .unwrap();

    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let c = race.session("C").await.unwrap();
    for (session, plan) in [
        (
            &a,
            "SET enable_indexscan = off; SET enable_bitmapscan = off",
        ),
        (&b, "SET enable_seqscan = off; SET enable_bitmapscan = off"),
    ] {
        sqlx::raw_sql(plan).execute(session.pool()).await.unwrap();
    }
    let rc = IsolationLevel::ReadCommitted;
    let mut tx_c = race
        .try_step(&c, "BEGIN", pgonce::begin(c.pool(), rc))
        .await
        .unwrap();
    let taken = race
        .try_step(&c, "next(acme)", seq.next(&mut tx_c, &"acme"))
        .await
        .unwrap();
    assert_eq!(taken.number, 3);
    insert_incident(&mut tx_c, "acme", 3).await.unwrap();

    let take = |session: &Session| {
        let (seq, pool) = (seq.clone(), session.pool().clone());
        async move {
            let mut tx = pgonce::begin(&pool, rc).await?;
            let number = seq.next(&mut tx, &"acme").await?.number;
            insert_incident(&mut tx, "acme", number).await?;
            Ok::<_, pgonce::Error>((number, tx))
        }
    };
    let a_waits = race.step_blocks(&a, "take(acme)", take(&a)).await.unwrap();
    assert_eq!(a_waits.blocked_by(), ["C"]);
    let b_waits = race.step_blocks(&b, "take(acme)", take(&b)).await.unwrap();
    assert_eq!(b_waits.blocked_by(), ["A"], "B queues behind A");

    race.try_step(&c, "COMMIT", tx_c.commit()).await.unwrap();
    let (number, tx_a) = a_waits.resume().await.unwrap().unwrap();
    assert_eq!(number, 4);
    race.try_step(&a, "COMMIT", tx_a.commit()).await.unwrap();
    let (number, tx_b) = b_waits.resume().await.unwrap().unwrap();
    assert_eq!(number, 5);
    tx_b.commit().await.unwrap();
    assert_eq!(committed(&pool).await["acme"], [1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn the_declarations_other_work_commits_atomically_with_its_number() {
    let (pool, _db) = setup(4).await;
    let seq = sequence(Strategy::AdvisoryLock);
    let work = async |pool: &PgPool| -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM declaration_work")
            .fetch_one(pool)
            .await
            .unwrap()
    };

    // The write that stores the number fails after the other work was done:
    // neither the work nor the number is committed.
    let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    sqlx::query("INSERT INTO declaration_work (org, note) VALUES ('acme', 'slack channel')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = seq
        .commit_numbered(tx, &"acme", async |conn: &mut PgConnection, number| {
            insert_incident(conn, "acme", number).await?;
            sqlx::query("SELECT 1 / 0").execute(conn).await?;
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Database(_)), "{err}");
    assert_eq!(work(&pool).await, 0, "the other work rolled back");
    assert!(committed(&pool).await.is_empty(), "no number committed");

    // A declaration that succeeds commits both.
    assert_eq!(declare(&seq, &pool, "acme").await.unwrap(), 1);
    assert_eq!(work(&pool).await, 1);
    assert_eq!(committed(&pool).await["acme"], [1]);
}

#[tokio::test]
async fn the_wrong_isolation_level_is_a_typed_error_and_takes_no_lock() {
    let (pool, _db) = setup(4).await;
    for level in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable] {
        for strategy in Strategy::ALL {
            let seq = sequence(strategy);
            let mut tx = pgonce::begin(&pool, level).await.unwrap();
            let outcome = seq.next(&mut tx, &"acme").await;
            if strategy == Strategy::CounterRow {
                // A row lock plus snapshot isolation aborts instead of
                // duplicating, so the counter row accepts every level.
                assert_eq!(outcome.unwrap().number, 1, "{level}");
                tx.rollback().await.unwrap();
                continue;
            }
            let err = outcome.unwrap_err();
            assert!(
                matches!(&err, Error::WrongIsolation { needed: "READ COMMITTED", found, .. }
                    if *found == level.as_sql().to_lowercase()),
                "{strategy} {level}: {err}"
            );
            assert_eq!(
                scope_locks_held(&mut tx).await,
                0,
                "{strategy} {level}: nothing locked"
            );
        }
    }
}

/// Why the check exists: under REPEATABLE READ the snapshot is taken by the
/// transaction's first statement, here the lock statement, before the lock
/// is granted. The max read after the wait is stale: the same number twice.
#[tokio::test]
async fn without_the_check_repeatable_read_would_compute_a_duplicate() {
    let (_pool, db) = setup(4).await;
    let seq = sequence(Strategy::AdvisoryLock);
    let key = seq.lock_key(&"acme").unwrap().as_i64();
    let (race, tx_a, b) = a_holds_acme(&db, &seq).await;

    let pool_b = b.pool().clone();
    let waiting = race
        .step_blocks(&b, "lock + max under RR", async move {
            let mut tx = pgonce::begin(&pool_b, IsolationLevel::RepeatableRead).await?;
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(key)
                .execute(&mut *tx)
                .await?;
            let n: i64 = sqlx::query_scalar(
                "SELECT COALESCE(max(number), 0) + 1 FROM incidents WHERE org = 'acme'",
            )
            .fetch_one(&mut *tx)
            .await?;
            tx.rollback().await?;
            Ok::<_, sqlx::Error>(n)
        })
        .await
        .unwrap();
    tx_a.commit().await.unwrap();
    assert_eq!(
        waiting.resume().await.unwrap().unwrap(),
        1,
        "stale: the number A just committed"
    );
}

#[tokio::test]
async fn a_table_without_the_unique_index_is_rejected() {
    let (pool, _db) = setup(2).await;
    sequence(Strategy::AdvisoryLock)
        .check_schema(&pool)
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE public.loose (org text, number bigint)")
        .execute(&pool)
        .await
        .unwrap();
    let loose = Sequence::new(
        NumberedTable::new("loose", "org", "number").unwrap(),
        SequenceConfig::default(),
    )
    .unwrap();
    let err = loose.check_schema(&pool).await.unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err}");
}

/// A number column that is not a smallint, an integer or a bigint is
/// refused by `check_schema`: a `numeric(5,0)` passed, and at 99999 the
/// take handed out 100000, which the caller's insert refused with a raw
/// "numeric field overflow"; a domain with a CHECK the same way.
#[tokio::test]
async fn a_number_column_of_another_type_is_rejected() {
    let (pool, _db) = setup(2).await;
    sqlx::raw_sql(
        "CREATE DOMAIN public.small_number AS int CHECK (VALUE < 100); \
         CREATE TABLE public.by_numeric (org text, number numeric(5,0), UNIQUE (org, number)); \
         CREATE TABLE public.by_domain (org text, number public.small_number, UNIQUE (org, number)); \
         CREATE TABLE public.by_int (org text, number int, UNIQUE (org, number));",
    )
    .execute(&pool)
    .await
    .unwrap();
    let check = |table: &'static str| {
        let pool = pool.clone();
        async move {
            Sequence::new(
                NumberedTable::new(table, "org", "number").unwrap(),
                SequenceConfig::default(),
            )
            .unwrap()
            .check_schema(&pool)
            .await
        }
    };
    for table in ["by_numeric", "by_domain"] {
        let err = check(table).await;
        assert!(
            matches!(&err, Err(Error::Invalid { why, .. }) if why.contains("smallint, an integer or a bigint")),
            "{table}: {err:?}"
        );
    }
    check("by_int").await.unwrap();
}

#[tokio::test]
async fn a_scope_typed_as_the_column_binds_with_its_own_type() {
    let (pool, _db) = setup(2).await;
    sqlx::raw_sql(
        "CREATE TABLE public.app_tickets (org bigint NOT NULL, n int NOT NULL, PRIMARY KEY (org, n))",
    )
    .execute(&pool)
    .await
    .unwrap();
    for strategy in Strategy::ALL {
        let seq = Sequence::new(
            NumberedTable::new("public.app_tickets", "org", "n").unwrap(),
            SequenceConfig { strategy },
        )
        .unwrap();
        seq.check_schema(&pool).await.unwrap();
        let org = 7i64;
        let tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        let done = seq
            .commit_numbered(tx, &org, async |conn: &mut PgConnection, n| {
                sqlx::query("INSERT INTO app_tickets (org, n) VALUES ($1, $2::int)")
                    .bind(org)
                    .bind(n)
                    .execute(conn)
                    .await?;
                Ok(())
            })
            .await
            .unwrap();
        assert!(done.held >= std::time::Duration::ZERO);
    }
    let ns: Vec<i32> = sqlx::query_scalar("SELECT n FROM app_tickets ORDER BY n")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        ns,
        [1, 2, 3, 4],
        "strategies continue one another's numbers"
    );
}

/// Only the (scope, number) index's violation is a taken number: the write
/// breaking another unique index of the same table is the caller's error,
/// not NumberTaken (retrying would take the same number and fail again).
/// Every strategy numbers the same scope in turn, each several times and
/// the counter row between each of the others: a strategy changed between
/// two deploys, or two running side by side during one. The counter row
/// never falls behind numbers taken under the other locks (it used to,
/// and then every later counter-row take was refused as taken and rolled
/// back, for good).
#[tokio::test]
async fn strategies_take_turns_on_one_scope_and_continue_one_anothers_numbers() {
    let (pool, _db) = setup(4).await;
    let counter = sequence(Strategy::CounterRow);
    let mut expected = 0;
    for other in [
        Strategy::AdvisoryLock,
        Strategy::TableLock,
        Strategy::SelectForUpdate,
    ] {
        for seq in [
            &counter,
            &sequence(other),
            &sequence(other),
            &counter,
            &counter,
        ] {
            expected += 1;
            assert_eq!(declare(seq, &pool, "acme").await.unwrap(), expected);
        }
    }
    assert_eq!(
        committed(&pool).await["acme"],
        (1..=expected).collect::<Vec<_>>()
    );
}

/// Two strategies side by side on one scope at the same moment (a deploy
/// switching strategies, both versions running) do not lock each other
/// out: each takes its own lock (an advisory lock, the counter row, the
/// table), so the second computes the number the first holds, and its
/// INSERT waits on the first's index entry (or, after a table lock, on the
/// table). When the first commits, the unique index refuses the second:
/// `NumberTaken`, its transaction rolled back, never a duplicate or a gap,
/// and its retry takes the next number. Shown step by step for each
/// strategy whose lock the other does not take, holder first.
#[tokio::test]
async fn two_strategies_at_once_on_one_scope_refuse_the_second_as_taken_never_a_duplicate() {
    let (pool, db) = setup(8).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let pairs = [
        (Strategy::AdvisoryLock, Strategy::CounterRow),
        (Strategy::CounterRow, Strategy::AdvisoryLock),
        (Strategy::TableLock, Strategy::AdvisoryLock),
        (Strategy::TableLock, Strategy::CounterRow),
    ];
    for (holder, second) in pairs {
        let scope = format!("{holder}-then-{second}");
        let mut tx_a = pgonce::begin(a.pool(), IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        let taken = race
            .step(&a, "next", sequence(holder).next(&mut tx_a, &scope))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(taken.number, 1);
        insert_incident(&mut tx_a, &scope, 1).await.unwrap();
        let (pool_b, scope_b) = (b.pool().clone(), scope.clone());
        let waiting = race
            .step_blocks(&b, "declare", async move {
                declare(&sequence(second), &pool_b, &scope_b).await
            })
            .await
            .unwrap();
        assert_eq!(waiting.blocked_by(), ["A"], "{scope}");
        race.step(&a, "COMMIT", tx_a.commit())
            .await
            .unwrap()
            .unwrap();
        let refused = waiting.resume().await.unwrap();
        assert!(
            matches!(&refused, Err(Error::NumberTaken { number: 1, .. })),
            "{scope}: {refused:?}"
        );
        assert_eq!(declare(&sequence(second), &pool, &scope).await.unwrap(), 2);
        assert_eq!(committed(&pool).await[&scope], [1, 2], "{scope}");
    }
}

#[tokio::test]
async fn another_unique_index_of_the_table_is_not_a_taken_number() {
    let (pool, _db) = setup(2).await;
    sqlx::raw_sql(
        "CREATE TABLE public.tickets (org text NOT NULL, number bigint NOT NULL, \
         ref text UNIQUE, UNIQUE (org, number)); \
         INSERT INTO public.tickets VALUES ('acme', 1, 'r-1')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let seq = Sequence::new(
        NumberedTable::new("public.tickets", "org", "number").unwrap(),
        SequenceConfig::default(),
    )
    .unwrap();
    let tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    let err = seq
        .commit_numbered(tx, &"acme", async |conn: &mut PgConnection, n| {
            sqlx::query("INSERT INTO public.tickets VALUES ('acme', $1, 'r-1')")
                .bind(n)
                .execute(conn)
                .await?;
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Database(_)), "{err}");
}

/// A savepoint's "commit" is a RELEASE SAVEPOINT: it commits nothing, and
/// the outer transaction may still roll the number back. So
/// `commit_numbered` refuses a nested transaction before it locks or writes
/// anything (it used to report the number as committed), rolls the
/// savepoint back, and leaves the outer transaction usable.
#[tokio::test]
async fn commit_numbered_refuses_a_savepoint_as_its_release_commits_nothing() {
    let (pool, _db) = setup(4).await;
    for strategy in Strategy::ALL {
        let seq = sequence(strategy);
        let mut outer = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        sqlx::query("INSERT INTO declaration_work (org, note) VALUES ('acme', 'outer')")
            .execute(&mut *outer)
            .await
            .unwrap();
        let savepoint = sqlx::Acquire::begin(&mut outer).await.unwrap();
        let mut wrote = false;
        let outcome = seq
            .commit_numbered(savepoint, &"acme", async |conn: &mut PgConnection, n| {
                wrote = true;
                insert_incident(conn, "acme", n).await
            })
            .await;
        assert!(
            matches!(
                outcome,
                Err(Error::NestedTransaction {
                    operation: "commit_numbered",
                    depth: 2
                })
            ),
            "{strategy}: {outcome:?}"
        );
        assert!(!wrote, "{strategy}: the write never ran");
        assert_eq!(
            scope_locks_held(&mut outer).await,
            0,
            "{strategy}: nothing locked"
        );
        // The outer transaction is untouched and still usable; rolled back,
        // it leaves no number behind.
        let work: i64 = sqlx::query_scalar("SELECT count(*) FROM declaration_work")
            .fetch_one(&mut *outer)
            .await
            .unwrap();
        assert_eq!(work, 1, "{strategy}: the outer work is still there");
        outer.rollback().await.unwrap();
        assert!(committed(&pool).await.is_empty(), "{strategy}");
    }
    // The top-level transaction still works.
    let seq = sequence(Strategy::AdvisoryLock);
    assert_eq!(declare(&seq, &pool, "acme").await.unwrap(), 1);
}

/// Two sequences may number one table, each in its own columns (incidents
/// per organization, and per team). Under the counter row each keeps its own
/// counter: one moving on never skips numbers of the other.
#[tokio::test]
async fn two_sequences_of_one_table_keep_their_own_counters() {
    let (pool, _db) = setup(2).await;
    sqlx::raw_sql(
        "CREATE TABLE public.tasks (org text NOT NULL, org_number bigint NOT NULL, \
         team text NOT NULL, team_number bigint, \
         UNIQUE (org, org_number), UNIQUE (team, team_number))",
    )
    .execute(&pool)
    .await
    .unwrap();
    let counter = SequenceConfig {
        strategy: Strategy::CounterRow,
    };
    let per_org = Sequence::new(
        NumberedTable::new("public.tasks", "org", "org_number").unwrap(),
        counter.clone(),
    )
    .unwrap();
    let per_team = Sequence::new(
        NumberedTable::new("public.tasks", "team", "team_number").unwrap(),
        counter,
    )
    .unwrap();
    // A task of org "x" in team "y", then one of org "y" in team "x": the
    // organization and the team share a name, not a numbering.
    let mut numbers = Vec::new();
    for (org, team) in [("x", "y"), ("y", "x")] {
        let tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        let org_number = per_org
            .commit_numbered(tx, &org, async |conn: &mut PgConnection, n| {
                sqlx::query("INSERT INTO public.tasks (org, org_number, team) VALUES ($1, $2, $3)")
                    .bind(org)
                    .bind(n)
                    .bind(team)
                    .execute(conn)
                    .await?;
                Ok(())
            })
            .await
            .unwrap()
            .number;
        let tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        let team_number = per_team
            .commit_numbered(tx, &team, async |conn: &mut PgConnection, n| {
                sqlx::query(
                    "UPDATE public.tasks SET team_number = $2 \
                     WHERE org = $1 AND org_number = $3",
                )
                .bind(org)
                .bind(n)
                .bind(org_number)
                .execute(conn)
                .await?;
                Ok(())
            })
            .await
            .unwrap()
            .number;
        numbers.push((org_number, team_number));
    }
    assert_eq!(numbers, [(1, 1), (1, 1)]);
}

/// Two sequences taken in one transaction, in opposite orders by two
/// declarers (A: incidents then tickets; B: tickets then incidents), can
/// deadlock. PostgreSQL breaks it by aborting one of the two; that one gets
/// a typed, retryable error, and the other goes on to commit its numbers.
async fn opposite_orders_deadlock_into_a_retryable_error(strategy: Strategy) {
    let (pool, db) = setup(4).await;
    sqlx::raw_sql(
        "CREATE TABLE public.tickets (org text NOT NULL, number bigint NOT NULL, \
         UNIQUE (org, number))",
    )
    .execute(&pool)
    .await
    .unwrap();
    let incidents = sequence(strategy);
    let tickets = Sequence::new(
        NumberedTable::new("public.tickets", "org", "number").unwrap(),
        SequenceConfig { strategy },
    )
    .unwrap();
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let rc = IsolationLevel::ReadCommitted;
    let mut tx_a = race
        .try_step(&a, "BEGIN", pgonce::begin(a.pool(), rc))
        .await
        .unwrap();
    let mut tx_b = race
        .try_step(&b, "BEGIN", pgonce::begin(b.pool(), rc))
        .await
        .unwrap();
    race.try_step(&a, "incidents(x)", incidents.next(&mut tx_a, &"x"))
        .await
        .unwrap();
    race.try_step(&b, "tickets(x)", tickets.next(&mut tx_b, &"x"))
        .await
        .unwrap();
    let a_waits = race
        .step_blocks(&a, "tickets(x)", async move {
            let taken = tickets.next(&mut tx_a, &"x").await.map(|t| t.number);
            (taken, tx_a)
        })
        .await
        .unwrap();
    assert_eq!(a_waits.blocked_by(), ["B"], "{strategy}");
    // B closes the cycle; PostgreSQL's deadlock check aborts A or B.
    let b_takes = tokio::spawn(async move {
        let taken = incidents.next(&mut tx_b, &"x").await.map(|t| t.number);
        (taken, tx_b)
    });
    let (a_taken, tx_a) = a_waits.resume().await.unwrap();
    let (b_taken, tx_b) = b_takes.await.unwrap();
    let (lost, won, tx_won) = match (a_taken, b_taken) {
        (Err(lost), Ok(won)) => (lost, won, tx_b),
        (Ok(won), Err(lost)) => (lost, won, tx_a),
        other => panic!("{strategy}: exactly one side must lose, got {other:?}"),
    };
    assert!(
        matches!(&lost, Error::SerializationFailure { sqlstate, .. } if sqlstate == "40P01"),
        "{strategy}: {lost:?}"
    );
    assert!(lost.is_retryable(), "{strategy}");
    assert_eq!(won, 1, "{strategy}");
    tx_won.commit().await.unwrap();
}

#[tokio::test]
async fn opposite_orders_under_the_advisory_lock_deadlock_into_a_retryable_error() {
    opposite_orders_deadlock_into_a_retryable_error(Strategy::AdvisoryLock).await;
}

#[tokio::test]
async fn opposite_orders_under_the_counter_row_deadlock_into_a_retryable_error() {
    opposite_orders_deadlock_into_a_retryable_error(Strategy::CounterRow).await;
}

/// A scope whose numbers reached the column's largest value has no next
/// number: every strategy says so with a typed error naming the scope,
/// not a database error, and nothing is written.
#[tokio::test]
async fn a_scope_at_the_largest_number_is_exhausted_with_a_typed_error() {
    let (pool, _db) = setup(8).await;
    let mut conn = pool.acquire().await.unwrap();
    insert_incident(&mut conn, "full", i64::MAX).await.unwrap();
    drop(conn);
    for strategy in [
        Strategy::AdvisoryLock,
        Strategy::CounterRow,
        Strategy::TableLock,
        Strategy::SelectForUpdate,
    ] {
        let out = declare(&sequence(strategy), &pool, "full").await;
        assert!(
            matches!(&out, Err(Error::SequenceExhausted { scope, .. }) if scope == "full"),
            "{strategy:?}: {out:?}"
        );
    }
    assert_eq!(committed(&pool).await["full"], [i64::MAX]);
    // Other scopes go on.
    assert_eq!(
        declare(&sequence(Strategy::AdvisoryLock), &pool, "other")
            .await
            .unwrap(),
        1
    );
}

/// The counter row on an `int` column ahead of the table (a take committed
/// without its row, then a row deleted: the gaps the module documents),
/// at the column's largest value. Its upsert moved the counter in `bigint`,
/// so `next` handed out 2147483648, which the column cannot hold, and the
/// write failed with a raw out-of-range error. It is the scope exhausted,
/// as for the other strategies and for a counter level with the table.
#[tokio::test]
async fn a_counter_ahead_of_an_int_column_at_its_largest_value_is_exhausted() {
    let (pool, _db) = setup(2).await;
    sqlx::raw_sql(
        "CREATE TABLE public.int_tickets (org text NOT NULL, n int NOT NULL, PRIMARY KEY (org, n))",
    )
    .execute(&pool)
    .await
    .unwrap();
    let seq = Sequence::new(
        NumberedTable::new("public.int_tickets", "org", "n").unwrap(),
        SequenceConfig {
            strategy: Strategy::CounterRow,
        },
    )
    .unwrap();
    let take = async || {
        let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        let out = seq.next(&mut tx, &"full").await.map(|taken| taken.number);
        tx.commit().await.ok();
        out
    };
    // The scope's counter created at the column's largest value, that
    // number then given up (committed without its row).
    sqlx::query("INSERT INTO int_tickets (org, n) VALUES ('full', 2147483646)")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(take().await.unwrap(), i64::from(i32::MAX));
    let out = take().await;
    assert!(
        matches!(&out, Err(Error::SequenceExhausted { scope, .. }) if scope == "full"),
        "{out:?}"
    );
    // A row deleted: the counter is further ahead, and still exhausted.
    sqlx::query("DELETE FROM int_tickets")
        .execute(&pool)
        .await
        .unwrap();
    let out = take().await;
    assert!(
        matches!(&out, Err(Error::SequenceExhausted { scope, .. }) if scope == "full"),
        "{out:?}"
    );
    let last: i64 =
        sqlx::query_scalar("SELECT last_number FROM pgonce.sequence_counters WHERE scope = 'full'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(last, i64::from(i32::MAX));
}

/// A `smallint` number column at its largest value, 32767: every strategy
/// computed the next number in a wider type, so `next` handed out 32768,
/// which the column cannot hold, and the declaration's write failed with a
/// raw "smallint out of range". It is the scope exhausted, a typed error,
/// under every strategy, with nothing written and the counter row left
/// where it was; other scopes go on.
#[tokio::test]
async fn a_smallint_column_at_its_largest_value_is_exhausted_under_every_strategy() {
    let (pool, _db) = setup(2).await;
    sqlx::raw_sql(
        "CREATE TABLE public.small_tickets (org text NOT NULL, n smallint NOT NULL, \
         PRIMARY KEY (org, n)); \
         INSERT INTO public.small_tickets (org, n) VALUES ('full', 32767);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let insert = "INSERT INTO public.small_tickets (org, n) VALUES ($1, $2)";
    for strategy in Strategy::ALL {
        let seq = sequence_over("public.small_tickets", strategy);
        // The low-level take, then the whole declaration.
        let taken = take_and_roll_back(&seq, &pool, "full").await;
        assert!(
            matches!(&taken, Err(Error::SequenceExhausted { scope, .. }) if scope == "full"),
            "{strategy:?}: next gave {taken:?}"
        );
        let declared = declare_into(&seq, &pool, insert, &"full").await;
        assert!(
            declared
                .as_ref()
                .is_err_and(|e| e.contains("exhausted") && e.contains("full")),
            "{strategy:?}: the declaration gave {declared:?}"
        );
        assert_eq!(
            declare_into(&seq, &pool, insert, &format!("other-{strategy}")).await,
            Ok(1),
            "{strategy:?}"
        );
    }
    let numbers: Vec<i16> =
        sqlx::query_scalar("SELECT n FROM public.small_tickets WHERE org = 'full'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(numbers, [32767]);
    let counters: Vec<i64> =
        sqlx::query_scalar("SELECT last_number FROM pgonce.sequence_counters WHERE scope = 'full'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(
        counters.iter().all(|&n| n <= 32767),
        "the counter row moved past the column: {counters:?}"
    );
}

/// A declaration of `scope` whose write records that it ran.
async fn declare_noting_the_write(
    seq: &Sequence,
    pool: &PgPool,
    scope: &str,
    wrote: &mut bool,
) -> pgonce::Result<i64> {
    let tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
    let declared = seq
        .commit_numbered(tx, &scope, async |conn: &mut PgConnection, number| {
            *wrote = true;
            insert_incident(conn, scope, number).await
        })
        .await?;
    Ok(declared.number)
}

/// A declaration of `scope` on a table of its own: `insert` stores the
/// scope ($1) and the number ($2).
async fn declare_into<S: pgonce::ScopeValue>(
    seq: &Sequence,
    pool: &PgPool,
    insert: &str,
    scope: &S,
) -> Result<i64, String> {
    let tx = pgonce::begin(pool, IsolationLevel::ReadCommitted)
        .await
        .map_err(|e| e.to_string())?;
    seq.commit_numbered(tx, scope, async |conn: &mut PgConnection, number| {
        sqlx::query(sqlx::AssertSqlSafe(insert))
            .bind(scope)
            .bind(number)
            .execute(conn)
            .await?;
        Ok(())
    })
    .await
    .map(|d| d.number)
    .map_err(|e| e.to_string())
}

/// A scope whose type does not compare with its column's (an integer
/// scope on the text column `org`) is a typed error naming the column,
/// under every strategy: it used to be PostgreSQL's "operator does not
/// exist: text = bigint" (42883), which reads as a bug in the library.
#[tokio::test]
async fn a_scope_of_another_type_than_its_column_is_a_typed_error() {
    let (pool, _db) = setup(2).await;
    for strategy in Strategy::ALL {
        let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        match sequence(strategy).next(&mut tx, &7_i64).await {
            Err(Error::Invalid { what, why }) => {
                assert_eq!(what, "sequence scope", "{strategy}");
                assert!(why.contains("column org"), "{strategy}: {why}");
            }
            other => panic!("{strategy}: {other:?}"),
        }
    }
}

/// A number column of a type with no next number (text, not one of the
/// integer types the module documents) is not blamed on the scope: the
/// scope `"acme"` compares with its text column, and the error says what
/// PostgreSQL says of the number column, whatever the strategy.
#[tokio::test]
async fn a_number_column_of_another_type_is_not_blamed_on_the_scope() {
    let (pool, _db) = setup(2).await;
    sqlx::raw_sql(
        "CREATE TABLE public.text_numbers (org text NOT NULL, n text NOT NULL, \
         PRIMARY KEY (org, n))",
    )
    .execute(&pool)
    .await
    .unwrap();
    for strategy in Strategy::ALL {
        let out = take_and_roll_back(
            &sequence_over("public.text_numbers", strategy),
            &pool,
            "acme",
        )
        .await;
        assert!(
            matches!(&out, Err(Error::Database(_))),
            "{strategy}: {out:?}"
        );
    }
}

/// A scope the indexes cannot hold (longer than one B-tree entry, 2704
/// bytes, holds once compressed; or holding NUL, which PostgreSQL's text
/// cannot) is refused under every strategy before any statement. It used
/// to reach the database: SQLSTATE 54000 from the counter row's key or the
/// numbered table's (scope, number) index, 22021 for NUL, raised inside the
/// caller's transaction and aborting it. Now the transaction is untouched
/// and goes on to number another scope.
#[tokio::test]
async fn a_scope_the_indexes_cannot_hold_is_refused_before_any_statement() {
    let (pool, _db) = setup(4).await;
    // Past what any B-tree entry holds; then just past the longest allowed.
    let past_any_entry = incompressible(2705);
    let past_the_longest = incompressible(Sequence::MAX_SCOPE_BYTES + 1);
    for strategy in Strategy::ALL {
        let seq = sequence(strategy);
        for scope in [&past_any_entry, "a\0b", &past_the_longest] {
            let mut wrote = false;
            let out = declare_noting_the_write(&seq, &pool, scope, &mut wrote).await;
            assert!(
                matches!(
                    &out,
                    Err(Error::Invalid {
                        what: "sequence scope",
                        ..
                    })
                ),
                "{strategy}, scope of {} bytes: {out:?}",
                scope.len()
            );
            assert!(!wrote, "{strategy}: the write never ran");

            let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
                .await
                .unwrap();
            let out = seq.next(&mut tx, &scope).await;
            assert!(
                matches!(
                    &out,
                    Err(Error::Invalid {
                        what: "sequence scope",
                        ..
                    })
                ),
                "{strategy}: {out:?}"
            );
            assert_eq!(
                scope_locks_held(&mut tx).await,
                0,
                "{strategy}: nothing locked"
            );
            let taken = seq.next(&mut tx, &"acme").await.unwrap();
            assert_eq!(taken.number, 1, "{strategy}: the transaction goes on");
            tx.rollback().await.unwrap();
        }
    }
    assert!(committed(&pool).await.is_empty());
}

/// The longest scope allowed fits every index it lands in whatever its
/// content (incompressible here) and whatever the table's names: under
/// every strategy, on a table whose four names are as long as names get,
/// every other character a `"` that doubles when quoted, so the counter
/// row's key carries a counter key of 389 bytes that does not compress.
#[tokio::test]
async fn the_longest_scope_fits_under_every_strategy_with_the_longest_names() {
    let (pool, _db) = setup(4).await;
    let letters = incompressible(4 * 32);
    let name = |i: usize| -> String {
        letters[i * 32..(i + 1) * 32]
            .chars()
            .flat_map(|c| [c, '"'])
            .take(63)
            .collect()
    };
    let (schema, table, scope_column, number_column) = (name(0), name(1), name(2), name(3));
    let q = |name: &str| format!("\"{}\"", name.replace('"', "\"\""));
    let ddl = format!(
        "CREATE SCHEMA {s}; CREATE TABLE {s}.{t} ({c} text NOT NULL, {n} bigint NOT NULL, \
         UNIQUE ({c}, {n}))",
        s = q(&schema),
        t = q(&table),
        c = q(&scope_column),
        n = q(&number_column),
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
        .execute(&pool)
        .await
        .unwrap();
    let insert = format!(
        "INSERT INTO {s}.{t} ({c}, {n}) VALUES ($1, $2)",
        s = q(&schema),
        t = q(&table),
        c = q(&scope_column),
        n = q(&number_column),
    );
    let numbered =
        NumberedTable::new(&format!("{schema}.{table}"), &scope_column, &number_column).unwrap();
    assert_eq!(numbered.counter_key().len(), 389);
    let longest = incompressible(Sequence::MAX_SCOPE_BYTES);
    for (i, strategy) in Strategy::ALL.into_iter().enumerate() {
        let seq = Sequence::new(numbered.clone(), SequenceConfig { strategy }).unwrap();
        assert_eq!(
            declare_into(&seq, &pool, &insert, &longest).await,
            Ok(i as i64 + 1),
            "{strategy}"
        );
        assert_eq!(
            declare(&sequence(strategy), &pool, &longest).await.unwrap(),
            i as i64 + 1
        );
    }
}

/// Values at the edges of what a scope may be are stored and read back
/// equal, and numbered 1..n, under every strategy (each continuing the
/// others' numbers): the empty string, characters outside the Basic
/// Multilingual Plane, spaces at either end, the same letter in two
/// normalisation forms (two scopes), and integers at the ends of `bigint`.
#[tokio::test]
async fn edge_scopes_are_numbered_and_read_back_equal_under_every_strategy() {
    let (pool, _db) = setup(4).await;
    sqlx::raw_sql(
        "CREATE TABLE public.by_id (org bigint NOT NULL, number bigint NOT NULL, \
         UNIQUE (org, number))",
    )
    .execute(&pool)
    .await
    .unwrap();
    let texts = [
        "",
        "\u{1F600}\u{1D11E}",
        "\u{10FFFF}",
        " a ",
        "e\u{301}",
        "\u{E9}",
    ];
    let ids = [i64::MIN, i64::MAX, 0, -1];
    let by_id = |strategy| {
        Sequence::new(
            NumberedTable::new("public.by_id", "org", "number").unwrap(),
            SequenceConfig { strategy },
        )
        .unwrap()
    };
    for (i, strategy) in Strategy::ALL.into_iter().enumerate() {
        let n = i as i64 + 1;
        for text in texts {
            assert_eq!(
                declare(&sequence(strategy), &pool, text)
                    .await
                    .map_err(|e| e.to_string()),
                Ok(n),
                "{strategy} {text:?}"
            );
        }
        for id in ids {
            assert_eq!(
                declare_into(
                    &by_id(strategy),
                    &pool,
                    "INSERT INTO by_id VALUES ($1, $2)",
                    &id
                )
                .await,
                Ok(n),
                "{strategy} {id}"
            );
        }
    }
    let all: Vec<i64> = (1..=Strategy::ALL.len() as i64).collect();
    let mut want: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for text in texts {
        want.insert(text.to_string(), all.clone());
    }
    assert_eq!(committed(&pool).await, want);
    #[derive(sqlx::FromRow, Debug, PartialEq)]
    struct ById {
        org: i64,
        numbers: Vec<i64>,
    }
    let rows: Vec<ById> = sqlx::query_as(
        "SELECT org, array_agg(number ORDER BY number) AS numbers FROM by_id GROUP BY org ORDER BY org",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut sorted = ids;
    sorted.sort();
    let want: Vec<ById> = sorted
        .iter()
        .map(|&org| ById {
            org,
            numbers: all.clone(),
        })
        .collect();
    assert_eq!(rows, want);
}
