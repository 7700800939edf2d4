//! The safeguards behind PgBouncer in `pool_mode = transaction`, where each
//! transaction may run on another server connection: nothing may depend on
//! session state. Migrations run over a direct connection (they take a
//! session-level lock); everything else goes through the pooler.

use std::collections::BTreeMap;
use std::time::Duration;

use pgonce::IsolationLevel;
use pgonce::guard::{Guard, GuardConfig, ReadSet};
use pgonce::queue::conformance::*;
use pgonce::{
    Listen, LockKey, NumberedTable, PgQueue, PgQueueOptions, QueueAttributes, Sequence,
    SequenceConfig, SequenceStrategy,
};
use pgonce_testkit::{
    Pooler, PoolerSetup, ScratchDatabase, fresh_database, fresh_database_behind_pooler,
    fresh_migrated_database_behind_pooler, shared_for_tests, wait_until,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};

const SCHEMA: &str = "
CREATE TABLE public.things (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                            entity text NOT NULL, open boolean NOT NULL DEFAULT true);
CREATE TABLE public.tickets (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                             org text NOT NULL, number bigint NOT NULL, UNIQUE (org, number));
";

/// A migrated scratch database, and a pool of `max` connections to it
/// through the pooler.
async fn setup(max: u32) -> (ScratchDatabase, PgPool) {
    fresh_migrated_database_behind_pooler(max, async |direct: &PgPool| {
        pgonce::migrate(direct).await?;
        sqlx::raw_sql(SCHEMA).execute(direct).await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    })
    .await
}

async fn open_things(conn: &mut PgConnection, entity: &str) -> pgonce::Result<ReadSet> {
    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM things WHERE entity = $1 AND open ORDER BY id")
            .bind(entity)
            .fetch_all(conn)
            .await?;
    Ok(ReadSet::from_ids(ids))
}

#[tokio::test]
async fn guarded_writes_through_the_pooler_open_one_row_per_entity() {
    let (_db, pool) = setup(10).await;
    let guard = Guard::new("things", GuardConfig::default()).unwrap();
    let mut writers = Vec::new();
    for _ in 0..20 {
        let (pool, guard) = (pool.clone(), guard.clone());
        writers.push(tokio::spawn(async move {
            let key = LockKey::new("things", "entity-1")?;
            let mut conn = pool.acquire().await?;
            let seen = open_things(&mut conn, "entity-1").await?;
            drop(conn);
            if seen != ReadSet::default() {
                // The decision: an entity with an open thing needs no other.
                return Ok(());
            }
            guard
                .write(
                    &pool,
                    key,
                    &seen,
                    async |conn| open_things(conn, "entity-1").await,
                    async |conn| {
                        sqlx::query("INSERT INTO things (entity) VALUES ('entity-1')")
                            .execute(conn)
                            .await?;
                        Ok(())
                    },
                )
                .await
        }));
    }
    for w in writers {
        let _ = w.await.unwrap();
    }
    let open: i64 = sqlx::query_scalar("SELECT count(*) FROM things WHERE open")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(open, 1);
}

/// One declarer through the pooler: `plans` declarations in `org`, each a
/// transaction of its own that takes a number, inserts it and commits, or
/// (every third) rolls back after the insert. A `NumberTaken` is retried
/// under select-for-update (the first declarations of a scope collide,
/// as documented), and an error under every other strategy. Returns the
/// numbers it committed.
async fn declare_through_the_pooler(
    pool: PgPool,
    seq: Sequence,
    org: String,
    worker: usize,
) -> pgonce::Result<Vec<i64>> {
    let mut committed = Vec::new();
    for i in 0..6usize {
        loop {
            let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted).await?;
            let taken = seq.next(&mut tx, &org).await?;
            let inserted = sqlx::query("INSERT INTO public.tickets (org, number) VALUES ($1, $2)")
                .bind(&org)
                .bind(taken.number)
                .execute(&mut *tx)
                .await;
            match inserted.map_err(|e| seq.number_taken(e.into(), &org, taken.number)) {
                Ok(_) => {}
                Err(pgonce::Error::NumberTaken { .. })
                    if seq.strategy() == SequenceStrategy::SelectForUpdate =>
                {
                    tx.rollback().await?;
                    continue;
                }
                Err(e) => return Err(e),
            }
            if (worker + i).is_multiple_of(3) {
                tx.rollback().await?;
            } else {
                tx.commit().await?;
                committed.push(taken.number);
            }
            break;
        }
    }
    Ok(committed)
}

/// Under every strategy, declarers in three scopes at once through the
/// pooler, each transaction on whatever server connection PgBouncer gives
/// it: every lock a strategy takes is transaction-level, so it lasts as
/// long as the server connection is the transaction's. Every scope's
/// committed numbers are 1..n, exactly the ones the declarers committed.
#[tokio::test]
async fn numbers_taken_through_the_pooler_are_1_to_n_under_every_strategy() {
    let (_db, pool) = setup(10).await;
    for strategy in SequenceStrategy::ALL {
        let seq = Sequence::new(
            NumberedTable::new("public.tickets", "org", "number").unwrap(),
            SequenceConfig { strategy },
        )
        .unwrap();
        let orgs: Vec<String> = (0..3).map(|k| format!("{strategy}-{k}")).collect();
        let mut declarers = Vec::new();
        for worker in 0..12usize {
            let org = orgs[worker % orgs.len()].clone();
            declarers.push(tokio::spawn(declare_through_the_pooler(
                pool.clone(),
                seq.clone(),
                org,
                worker,
            )));
        }
        let mut reported: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (worker, d) in declarers.into_iter().enumerate() {
            let numbers = d
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("{strategy}: through the pooler: {e}"));
            reported
                .entry(orgs[worker % orgs.len()].clone())
                .or_default()
                .extend(numbers);
        }
        for org in &orgs {
            let stored: Vec<i64> = sqlx::query_scalar(
                "SELECT number FROM public.tickets WHERE org = $1 ORDER BY number",
            )
            .bind(org)
            .fetch_all(&pool)
            .await
            .unwrap();
            let mut committed = reported[org].clone();
            committed.sort();
            assert_eq!(stored, committed, "{strategy} {org}: stored as committed");
            assert_eq!(
                stored,
                (1..=stored.len() as i64).collect::<Vec<_>>(),
                "{strategy} {org}: 1..n"
            );
        }
    }
}

/// A PgBouncer of its own that does not carry prepared statements (no
/// `max_prepared_statements`) in front of `db`, and a pool of two clients
/// through it.
async fn two_clients_without_prepared_statements(db: &ScratchDatabase) -> (Pooler, PgPool) {
    let server = shared_for_tests().unwrap();
    let pooler = Pooler::start_with(server.options(), PoolerSetup::NoPreparedStatements).unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(pooler.options(db.name()))
        .await
        .unwrap();
    (pooler, pool)
}

/// Whether `out` is the typed error of a pooler that does not carry
/// prepared statements.
fn is_prepared_statements_problem<T>(out: &pgonce::Result<T>) -> bool {
    matches!(
        out,
        Err(pgonce::Error::Pooler {
            problem: pgonce::PoolerProblem::PreparedStatements,
            ..
        })
    )
}

/// Behind a PgBouncer that does not carry prepared statements (no
/// `max_prepared_statements`), a take meets a server connection that
/// already holds a statement of the name it prepares. Under every strategy
/// that is the typed `Error::Pooler` naming the set-up, never a number
/// taken without its lock, and nothing is committed.
#[tokio::test]
async fn behind_a_pooler_without_prepared_statements_every_strategy_fails_typed() {
    let db = fresh_database().await;
    let direct = db.pool(1).await.unwrap();
    pgonce::migrate(&direct).await.unwrap();
    sqlx::raw_sql(SCHEMA).execute(&direct).await.unwrap();
    for strategy in SequenceStrategy::ALL {
        // A pooler of its own and clients one at a time: it has one server
        // connection, and the first client prepares `sqlx_s_1` on it and
        // stays.
        let (_pooler, pool) = two_clients_without_prepared_statements(&db).await;
        let mut first = pool.acquire().await.unwrap();
        let _ = sqlx::query("SELECT 1").execute(&mut *first).await;
        let seq = Sequence::new(
            NumberedTable::new("public.tickets", "org", "number").unwrap(),
            SequenceConfig { strategy },
        )
        .unwrap();
        let mut tx = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
            .await
            .unwrap();
        let out = seq.next(&mut tx, &"acme").await;
        assert!(is_prepared_statements_problem(&out), "{strategy}: {out:?}");
        tx.rollback().await.unwrap();
        drop(first);
        pool.close().await;
    }
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM public.tickets")
        .fetch_one(&direct)
        .await
        .unwrap();
    assert_eq!(stored, 0);
}

/// Two runners at once through the pooler: one applies each migration, the
/// other waits for it and then finds it applied; a third run is a no-op.
#[tokio::test]
async fn migrations_run_through_the_pooler_from_two_processes_at_once() {
    let (db, through_pooler) = fresh_database_behind_pooler().await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(through_pooler)
        .await
        .unwrap();
    let (a, b) = tokio::join!(pgonce::migrate(&pool), pgonce::migrate(&pool));
    a.unwrap();
    b.unwrap();
    pgonce::migrate(&pool).await.unwrap();
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(applied as usize, pgonce::MIGRATOR.iter().count());
    // No advisory lock is left behind on any server connection.
    let direct = db.pool(1).await.unwrap();
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&direct)
    .await
    .unwrap();
    assert_eq!(left, 0);
}

/// The queue's conformance suite through the pooler, with long polls
/// listening over a direct connection (`listen`) or not at all.
async fn queue_conformance_through_the_pooler(listen: impl Fn(&ScratchDatabase) -> Listen) {
    let (db, pool) = setup(20).await;
    let options = PgQueueOptions {
        poll_interval: Duration::from_millis(100),
        listen: listen(&db),
        ..PgQueueOptions::default()
    };
    let queue = async |name: &str, attributes: QueueAttributes| {
        PgQueue::create(&pool, name, attributes, options.clone())
            .await
            .unwrap()
    };
    let one_second = || QueueAttributes::default().visibility_timeout(Duration::from_secs(1));

    conformance_at_least_once_when_consumer_dies(&queue("dies", one_second()).await).await;
    conformance_fifo_order_with_many_consumers(&queue("order", QueueAttributes::fifo()).await)
        .await;
    conformance_fifo_groups_are_independent(&queue("groups", QueueAttributes::fifo()).await).await;
    conformance_stale_receipt(&queue("stale", one_second()).await).await;
    let dlq = queue("jobs-dlq", QueueAttributes::default()).await;
    let jobs = queue(
        "jobs",
        QueueAttributes::default().dead_letter("jobs-dlq", 2),
    )
    .await;
    conformance_dead_letter_and_redrive(&jobs, &dlq).await;
    conformance_dedup_within_window(&queue("dedup", QueueAttributes::default()).await).await;
    conformance_dedup_within_window(&queue("dedup-fifo", QueueAttributes::fifo()).await).await;
    let window = Duration::from_millis(500);
    let expiring = queue("window", QueueAttributes::default().dedup_window(window)).await;
    conformance_dedup_window_expires(&expiring, window).await;
    conformance_shutdown(&queue("shutdown", QueueAttributes::default()).await).await;
    let long_poll = queue("long-poll", QueueAttributes::default()).await;
    let parked = async {
        wait_until("a receive parked", || async {
            long_poll.parked_receivers() > 0
        })
        .await;
    };
    conformance_shutdown_during_a_long_poll(&long_poll, parked).await;
    let poison_dlq = queue("poison-dlq", QueueAttributes::default()).await;
    let poison = queue(
        "poison",
        QueueAttributes::default().dead_letter("poison-dlq", 2),
    )
    .await;
    conformance_malformed_bodies_reach_dead_letters(&poison, &poison_dlq).await;
    conformance_heartbeat_keeps_message_invisible(&queue("heartbeat", one_second()).await).await;
}

#[tokio::test]
async fn the_queue_conformance_suite_passes_through_the_pooler_listening_directly() {
    queue_conformance_through_the_pooler(|db| Listen::Direct(Box::new(db.options()))).await;
}

#[tokio::test]
async fn the_queue_conformance_suite_passes_through_the_pooler_without_listening() {
    queue_conformance_through_the_pooler(|_| Listen::Off).await;
}

/// A long poll through the pooler, listening over a direct connection, is
/// woken by a send committed through the pooler, not by its timer.
#[tokio::test]
async fn a_long_poll_through_the_pooler_wakes_on_send_over_a_direct_listener() {
    let (db, pool) = setup(4).await;
    let options = PgQueueOptions {
        poll_interval: Duration::from_secs(60),
        listen: Listen::Direct(Box::new(db.options())),
        ..PgQueueOptions::default()
    };
    let q = PgQueue::create(&pool, "q", QueueAttributes::default(), options)
        .await
        .unwrap();
    let parked = async {
        wait_until("a receive parked", || async { q.parked_receivers() > 0 }).await;
    };
    conformance_long_poll_wakes_on_send(&q, parked).await;
}

/// Conditional appends through the pooler, under each strategy: ten writers
/// decide "seat 1 is free" at once and each appends a booking with that
/// condition; exactly one booking commits, whatever server connection each
/// statement lands on.
#[tokio::test]
async fn conditional_appends_through_the_pooler_let_one_decision_win() {
    use pgonce::events::{
        AppendCondition, AppendStrategy, Event, EventStore, EventStoreConfig, Query,
    };

    for strategy in AppendStrategy::ALL {
        let (_db, pool) = setup(12).await;
        let store = EventStore::new(
            pool.clone(),
            EventStoreConfig {
                strategy,
                notify: false,
                ..Default::default()
            },
        )
        .unwrap();
        let seat = Query::item(Vec::<String>::new(), ["seat:1"]).unwrap();
        let mut decisions = Vec::new();
        for _ in 0..10 {
            decisions.push(store.decide(&seat).await.unwrap());
        }
        let writers = decisions.into_iter().enumerate().map(|(i, decision)| {
            let (store, seat) = (store.clone(), seat.clone());
            tokio::spawn(async move {
                let booking = Event::new("SeatBooked")
                    .tag("seat:1")
                    .data(serde_json::json!({ "by": i }));
                let condition = AppendCondition::new(seat, decision.after);
                store.append(&[booking], Some(&condition)).await
            })
        });
        let mut committed = 0;
        for writer in futures::future::join_all(writers).await {
            match writer.unwrap() {
                Ok(_) => committed += 1,
                Err(pgonce::Error::AppendConditionFailed { .. }) => {}
                Err(e) => panic!("{strategy:?}: unexpected error through the pooler: {e}"),
            }
        }
        let booked: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pgonce.events WHERE 'seat:1' = ANY (tags)")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!((committed, booked), (1, 1), "{strategy:?}");
    }
}

/// Jobs and idempotency keys through the pooler: each call is one statement,
/// and a lease or hold used in a transaction whose snapshot predates it asks
/// for a retry there too (the check runs in the statement, on whatever
/// server connection the transaction got).
#[tokio::test]
async fn jobs_and_idempotency_keys_through_the_pooler_keep_their_fences() {
    use pgonce::Error;
    use pgonce::dedupe::{self, Acquired};
    use pgonce::job::{self, JobStatus, NewJob, RetryPolicy};
    use serde_json::json;
    let (_db, pool) = setup(4).await;
    let lease_for = Duration::from_secs(60);
    let id = job::enqueue(&pool, &NewJob::new("k", json!({})))
        .await
        .unwrap();
    let mut tx = pgonce::begin(&pool, IsolationLevel::RepeatableRead)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM pgonce.jobs")
        .execute(&mut *tx)
        .await
        .unwrap();
    let lease = job::claim(&pool, id, lease_for).await.unwrap();
    let stale = job::complete(&mut *tx, &lease, &json!("r")).await;
    assert!(
        matches!(stale, Err(Error::SerializationFailure { .. })),
        "{stale:?}"
    );
    let _ = tx.rollback().await;
    let lease = job::heartbeat(&pool, &lease, lease_for).await.unwrap();
    let out = job::fail(&pool, &lease, "boom", &RetryPolicy::default()).await;
    assert!(matches!(out, Ok(job::FailOutcome::Retry { .. })), "{out:?}");
    let late = job::complete(&pool, &lease, &json!("late")).await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    let row = job::get(&pool, id).await.unwrap().unwrap();
    assert_eq!(row.status().unwrap(), JobStatus::Failed);

    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let mut tx = pgonce::begin(&pool, IsolationLevel::RepeatableRead)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM pgonce.idempotency_keys")
        .execute(&mut *tx)
        .await
        .unwrap();
    let Acquired::Process(hold) = dedupe::acquire(&pool, "api", "k", &fp, lease_for)
        .await
        .unwrap()
    else {
        panic!("new key");
    };
    let stale = dedupe::finish(&mut *tx, &hold, &json!("r")).await;
    assert!(
        matches!(stale, Err(Error::SerializationFailure { .. })),
        "{stale:?}"
    );
    let _ = tx.rollback().await;
    dedupe::finish(&pool, &hold, &json!("r")).await.unwrap();
    assert_eq!(
        dedupe::acquire(&pool, "api", "k", &fp, lease_for)
            .await
            .unwrap(),
        Acquired::Replay(json!("r"))
    );
}

/// Requests racing on one new idempotency key through the pooler: exactly
/// one takes it, each other is told it is in progress (its upsert took
/// nothing, and the read of why runs in the upsert's transaction, which
/// the pooler keeps on one server connection); none fails otherwise. Once
/// finished, every one of them replays the response.
#[tokio::test]
async fn racing_requests_on_one_key_through_the_pooler_take_it_once() {
    use pgonce::Error;
    use pgonce::dedupe::{self, Acquired};
    use serde_json::json;
    let (_db, pool) = setup(8).await;
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let hold_for = Duration::from_secs(60);
    let racing: Vec<_> = (0..8)
        .map(|_| {
            let (pool, fp) = (pool.clone(), fp.clone());
            tokio::spawn(async move { dedupe::acquire(&pool, "api", "k", &fp, hold_for).await })
        })
        .collect();
    let mut holds = Vec::new();
    let mut in_progress = 0;
    for r in racing {
        match r.await.unwrap() {
            Ok(Acquired::Process(hold)) => holds.push(hold),
            Err(Error::IdempotencyInProgress { .. }) => in_progress += 1,
            other => panic!("through the pooler: {other:?}"),
        }
    }
    assert_eq!((holds.len(), in_progress), (1, 7));
    dedupe::finish(&pool, &holds[0], &json!("r")).await.unwrap();
    for _ in 0..8 {
        assert_eq!(
            dedupe::acquire(&pool, "api", "k", &fp, hold_for)
                .await
                .unwrap(),
            Acquired::Replay(json!("r"))
        );
    }
}

#[tokio::test]
async fn a_bounded_lock_wait_through_the_pooler_times_out_typed_and_keeps_the_transaction() {
    let (_db, pool) = setup(4).await;
    let key = LockKey::new("things", "bounded").unwrap();
    let mut holder = pool.begin().await.unwrap();
    pgonce::lock::lock(&mut holder, key).await.unwrap();

    let mut waiter = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO things (entity) VALUES ('before the wait')")
        .execute(&mut *waiter)
        .await
        .unwrap();
    let err = pgonce::lock::lock_timeout(&mut waiter, key, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(
        matches!(err, pgonce::Error::LockTimeout { .. }),
        "a timeout behind the pooler is typed: {err}"
    );
    holder.commit().await.unwrap();
    // The same transaction, on the same server connection: it goes on,
    // takes the lock and commits what it wrote before the wait.
    pgonce::lock::lock_timeout(&mut waiter, key, Duration::from_secs(5))
        .await
        .unwrap();
    waiter.commit().await.unwrap();
    let written: i64 =
        sqlx::query_scalar("SELECT count(*) FROM things WHERE entity = 'before the wait'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(written, 1);
}

/// A receive through the pooler that moves a message to the dead-letter
/// queue wakes a receiver parked there (listening over a direct
/// connection, polling once an hour): the wake is sent in a transaction of
/// its own after the move committed, on whatever server connection the
/// pooler gives it.
#[tokio::test]
async fn a_dead_letter_move_through_the_pooler_wakes_the_dead_letter_queue() {
    use pgonce::Queue;
    let (db, pool) = setup(4).await;
    let options = PgQueueOptions {
        poll_interval: Duration::from_secs(3600),
        listen: Listen::Direct(Box::new(db.options())),
        ..PgQueueOptions::default()
    };
    let dlq = PgQueue::create(&pool, "q-dlq", QueueAttributes::default(), options.clone())
        .await
        .unwrap();
    let q = PgQueue::create(
        &pool,
        "q",
        QueueAttributes::default()
            .visibility_timeout(Duration::ZERO)
            .dead_letter("q-dlq", 1),
        options,
    )
    .await
    .unwrap();
    q.send(pgonce::SendMessage::new("poison")).await.unwrap();
    let once = q.receive(pgonce::ReceiveRequest::up_to(1)).await.unwrap();
    assert_eq!(once.len(), 1, "received once");
    let receiver = {
        let dlq = dlq.clone();
        tokio::spawn(async move {
            let request = pgonce::ReceiveRequest::up_to(1).wait(Duration::from_secs(3600));
            dlq.receive(request).await.unwrap()
        })
    };
    wait_until("a receive parked", || async { dlq.parked_receivers() > 0 }).await;
    let again = q.receive(pgonce::ReceiveRequest::up_to(1)).await.unwrap();
    assert!(again.is_empty(), "moved, not delivered");
    let got = tokio::time::timeout(Duration::from_secs(60), receiver)
        .await
        .expect("not woken by the move: it waits for its poll")
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body, "poison");
}

/// Behind a PgBouncer that does not carry prepared statements, a client
/// whose `sqlx_s_1` takes one parameter runs it on the server connection
/// where another client prepared its own `sqlx_s_1` with two: PostgreSQL
/// refuses the Bind (08P01, "bind message supplies 1 parameters, but
/// prepared statement \"sqlx_s_1\" requires 2"), which is the same
/// misconfiguration as 42P05 and 26000 and is told as such, not as a bare
/// database error. Driven step by step: a pooler of its own (so no other
/// client moves its server connections), the first client's transaction
/// pins one server connection while the second prepares on another, and
/// PgBouncer hands the second client the most recently released one.
#[tokio::test]
async fn a_statement_bound_on_another_clients_prepared_statement_is_a_pooler_problem() {
    let db = fresh_database().await;
    let direct = db.pool(1).await.unwrap();
    pgonce::migrate(&direct).await.unwrap();
    let (_pooler, pool) = two_clients_without_prepared_statements(&db).await;
    let mut first = pool.acquire().await.unwrap();
    let mut second = pool.acquire().await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut *first).await.unwrap();
    // The first client's `sqlx_s_1`, two parameters, on the server
    // connection its transaction holds.
    let first_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid() + $1::int - $2::int")
        .bind(0)
        .bind(0)
        .fetch_one(&mut *first)
        .await
        .unwrap();
    // The second client's `sqlx_s_1`, one parameter, on another one.
    assert!(pgonce::job::get(&mut *second, 1).await.unwrap().is_none());
    sqlx::raw_sql("COMMIT").execute(&mut *first).await.unwrap();
    let out = pgonce::job::get(&mut *second, 1).await;
    let ran_on: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *second)
        .await
        .unwrap();
    assert_eq!(
        ran_on, first_pid,
        "the second client got the first's server connection"
    );
    assert!(is_prepared_statements_problem(&out), "{out:?}");
    drop((first, second));
    pool.close().await;
}

/// A receive through the pooler dropped while its statement waits (for the
/// messages' table, which a direct connection holds locked): the server ran
/// it once the holder was gone, and the give-back that followed, on
/// whatever server connection the pooler gave it, returned both messages
/// uncounted before the client's one connection served the next receive.
#[tokio::test]
async fn a_receive_dropped_through_the_pooler_gives_its_messages_back() {
    use pgonce::Queue;
    let (db, pool) = setup(1).await;
    let q = PgQueue::create(
        &pool,
        "given-back",
        QueueAttributes::default().visibility_timeout(Duration::from_secs(3600)),
        PgQueueOptions::default(),
    )
    .await
    .unwrap();
    q.send_batch(vec![
        pgonce::SendMessage::new("m1"),
        pgonce::SendMessage::new("m2"),
    ])
    .await
    .unwrap();
    let direct = db.pool(2).await.unwrap();
    let mut holder = direct.begin().await.unwrap();
    sqlx::query("LOCK TABLE pgonce.queue_message IN EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let receive = {
        let q = q.clone();
        tokio::spawn(async move { q.receive(pgonce::ReceiveRequest::up_to(10)).await })
    };
    // Seen waiting for the holder (pg_blocking_pids) before it is dropped.
    loop {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid)))",
        )
        .bind(holder_pid)
        .fetch_one(&direct)
        .await
        .unwrap();
        assert!(!receive.is_finished(), "the receive did not wait");
        if waiting {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    receive.abort();
    assert!(receive.await.unwrap_err().is_cancelled());
    holder.rollback().await.unwrap();
    let got = q.receive(pgonce::ReceiveRequest::up_to(10)).await.unwrap();
    let bodies: Vec<&str> = got.iter().map(|m| m.body.as_str()).collect();
    assert_eq!(bodies, ["m1", "m2"], "receivable at once");
    for message in &got {
        assert_eq!(message.receive_count, 1, "{message:?}");
    }
}
