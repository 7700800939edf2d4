//! Pieces several test files share. Each test file is its own crate and
//! uses only some of them, hence the crate-wide `dead_code` allowance.
#![allow(dead_code)]

pub mod mixed;
pub mod queue_model;

use proptest::test_runner::{Config, FileFailurePersistence};

/// Text that does not compress: letters from a fixed pseudo-random sequence.
pub fn incompressible(len: usize) -> String {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from(b'a' + ((x >> 33) % 26) as u8)
        })
        .collect()
}

/// A READ COMMITTED transaction begun as a step of `session`, and its
/// backend's pid (to terminate it with).
pub async fn begin_noting_pid(
    race: &pgonce_testkit::Interleaving,
    session: &pgonce_testkit::Session,
) -> Result<(sqlx::Transaction<'static, sqlx::Postgres>, i32), String> {
    let mut tx = race
        .try_step(
            session,
            "BEGIN",
            pgonce::begin(session.pool(), pgonce::IsolationLevel::ReadCommitted),
        )
        .await
        .map_err(|e| e.to_string())?;
    let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    Ok((tx, pid))
}

/// Makes job `id`'s lease look expired without waiting for it: time
/// passing is not what these tests are about.
pub async fn expire_lease(pool: &sqlx::PgPool, id: i64) {
    sqlx::query(
        "UPDATE pgonce.jobs SET lease_expires_at = now() - interval '1 second' \
         WHERE id = $1 AND status = 'processing'",
    )
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

/// The environment variable that sets every model's number of cases.
pub const CASES_VAR: &str = "MODEL_TEST_CASES";

/// A proptest configuration for a model checked against PostgreSQL:
/// `default_cases` cases unless `MODEL_TEST_CASES` says otherwise, and
/// a failing case's seed persisted beside the test file
/// (`tests/<file>.proptest-regressions`, committed), so the next run
/// replays it first.
///
/// `WithSource` rather than proptest's default `SourceParallel`: the
/// default looks for a `lib.rs` above the test file, finds none under
/// `tests/`, warns, and falls back to this same path.
pub fn model_config(default_cases: u32) -> Config {
    let cases = std::env::var(CASES_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    }
}

/// Checks a model of the contract against PostgreSQL: proptest draws
/// sequences of operations from `ops` ([`model_config`] with
/// `default_cases`; a failing case persisted beside `source_file`, the
/// caller's `file!()`), and `run` applies case `n`'s sequence to the model
/// and to the database, returning the first divergence. A divergence fails
/// the test with the shrunk sequence. Prints the cases, steps and time,
/// and returns the tally `run` kept over every case, so the caller can
/// check the run reached the paths it is about.
pub fn check_model<Op: std::fmt::Debug + Clone, T: std::fmt::Debug + Copy>(
    source_file: &'static str,
    default_cases: u32,
    ops: impl proptest::strategy::Strategy<Value = Vec<Op>>,
    tally: T,
    run: impl Fn(u64, &[Op], &mut T) -> Result<(), String>,
) -> T {
    use std::sync::atomic::{AtomicU64, Ordering};

    let mut config = model_config(default_cases);
    config.source_file = Some(source_file);
    let cases = AtomicU64::new(0);
    let steps = AtomicU64::new(0);
    let tally = std::sync::Mutex::new(tally);
    let started = std::time::Instant::now();
    let outcome = proptest::test_runner::TestRunner::new(config).run(&ops, |ops| {
        let case = cases.fetch_add(1, Ordering::Relaxed);
        steps.fetch_add(ops.len() as u64, Ordering::Relaxed);
        let mut tally = tally.lock().unwrap_or_else(|e| e.into_inner());
        run(case, &ops, &mut tally).map_err(proptest::test_runner::TestCaseError::fail)
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
    let tally = *tally.lock().unwrap_or_else(|e| e.into_inner());
    eprintln!(
        "{} cases, {} steps, zero divergence, in {:?}; {tally:?}",
        cases.load(Ordering::Relaxed),
        steps.load(Ordering::Relaxed),
        started.elapsed(),
    );
    tally
}

/// A model's run against PostgreSQL, one operation at a time: what
/// [`steps_until_divergence`] drives.
// Its futures are awaited on the test's one runtime, never spawned: no
// `Send` bound is needed.
#[allow(async_fn_in_trait)]
pub trait StepByStep {
    type Op: std::fmt::Debug;
    type Tally;
    /// Applies `op` to the model and to the database; the first
    /// divergence.
    async fn step(&mut self, op: &Self::Op, tally: &mut Self::Tally) -> Result<(), String>;
    /// Compares the database with the model.
    async fn compare(&self) -> Result<(), String>;
}

/// Applies `ops` in turn, comparing the database with the model after
/// each; the first divergence, named by `label` and its step.
pub async fn steps_until_divergence<R: StepByStep>(
    run: &mut R,
    label: &str,
    ops: &[R::Op],
    tally: &mut R::Tally,
) -> Result<(), String> {
    for (i, op) in ops.iter().enumerate() {
        let at = format!("{label}, step {i} {op:?}");
        run.step(op, tally)
            .await
            .map_err(|e| format!("{at}: {e}"))?;
        run.compare()
            .await
            .map_err(|e| format!("after {at}: {e}"))?;
    }
    Ok(())
}

/// Ends what a model's connection left when its run stopped: its open
/// transaction `tx`, or its step still `waiting`, ends with its backend
/// `pid` (terminated from `checker`) before the next run, for a dropped
/// transaction's ROLLBACK waits for the connection's next use.
pub async fn end_with_backend<T>(
    checker: &sqlx::PgPool,
    pid: i32,
    tx: Option<sqlx::Transaction<'static, sqlx::Postgres>>,
    waiting: Option<pgonce_testkit::Blocked<T>>,
) {
    if tx.is_some() || waiting.is_some() {
        let _ = sqlx::query("SELECT pg_terminate_backend($1, 10000)")
            .bind(pid)
            .execute(checker)
            .await;
    }
    drop(tx);
    if let Some(waiting) = waiting {
        let _ = waiting.resume().await;
    }
}

/// A metrics recorder that hands each counter's registration to `F` (which
/// returns the counter to record into) and ignores gauges, histograms and
/// descriptions: a test installs it with
/// `metrics::set_default_local_recorder` to watch one counter.
pub struct OnCounter<F>(pub F);

/// What a test recorder ignores: descriptions and histograms.
macro_rules! ignore_descriptions_and_histograms {
    () => {
        fn register_histogram(
            &self,
            _: &metrics::Key,
            _: &metrics::Metadata<'_>,
        ) -> metrics::Histogram {
            metrics::Histogram::noop()
        }
        fn describe_counter(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_gauge(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
    };
}

impl<F: Fn(&metrics::Key) -> metrics::Counter> metrics::Recorder for OnCounter<F> {
    ignore_descriptions_and_histograms!();
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        (self.0)(key)
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
}

/// [`OnCounter`] for gauges: hands each gauge's registration to `F` and
/// ignores the rest.
pub struct OnGauge<F>(pub F);

impl<F: Fn(&metrics::Key) -> metrics::Gauge> metrics::Recorder for OnGauge<F> {
    ignore_descriptions_and_histograms!();
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        (self.0)(key)
    }
}

/// Watches one gauge: what `name` reads (under any labels, summed), and the
/// recorder that feeds it, to install with
/// `metrics::set_default_local_recorder`.
pub fn gauge_of(
    name: &'static str,
) -> (
    impl Fn() -> f64,
    OnGauge<impl Fn(&metrics::Key) -> metrics::Gauge>,
) {
    // metrics keeps a gauge in an AtomicU64 as the bits of an f64.
    let bits = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0.0f64.to_bits()));
    let feed = std::sync::Arc::clone(&bits);
    let recorder = OnGauge(move |key: &metrics::Key| {
        if key.name() == name {
            metrics::Gauge::from_arc(std::sync::Arc::clone(&feed))
        } else {
            metrics::Gauge::noop()
        }
    });
    let read = move || f64::from_bits(bits.load(std::sync::atomic::Ordering::SeqCst));
    (read, recorder)
}

/// Watches one counter: the total added to `name` (under any labels), and
/// the recorder that feeds it, to install with
/// `metrics::set_default_local_recorder`.
pub fn count_of(
    name: &'static str,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicU64>,
    OnCounter<impl Fn(&metrics::Key) -> metrics::Counter>,
) {
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let feed = std::sync::Arc::clone(&count);
    let recorder = OnCounter(move |key: &metrics::Key| {
        if key.name() == name {
            metrics::Counter::from_arc(std::sync::Arc::clone(&feed))
        } else {
            metrics::Counter::noop()
        }
    });
    (count, recorder)
}

/// A database of its own (for sessions of a race) with queue `name`, and
/// a pool of two on it for the setup and the checks.
pub async fn database_with_queue(
    name: &str,
    attributes: pgonce::QueueAttributes,
) -> (pgonce_testkit::ScratchDatabase, sqlx::PgPool) {
    let db = pgonce_testkit::fresh_database().await;
    let setup = db.pool(2).await.unwrap();
    pgonce::migrate(&setup).await.unwrap();
    pgonce::PgQueue::create(&setup, name, attributes, pgonce::PgQueueOptions::default())
        .await
        .unwrap();
    (db, setup)
}

/// What a step `step` makes, run in `session`, ends with once it has been
/// seen waiting for `holder` (a session of `race`) and that wait has run
/// out: for waits a timeout of the session ends (`timeout`, the setting:
/// `lock_timeout`, `statement_timeout`; the test set it to `first`).
///
/// A step that ended before the harness saw it waiting proves nothing
/// about what it waited for: the test process was not run for as long as
/// the timeout (a busy machine). It runs again with the timeout doubled,
/// up to 16 s; a step that never waits never passes.
pub async fn outcome_of_blocked_wait<T, F>(
    race: &pgonce_testkit::Interleaving,
    session: &pgonce_testkit::Session,
    holder: &str,
    what: &str,
    (timeout, first): (&str, std::time::Duration),
    mut step: impl FnMut() -> F,
) -> T
where
    T: Send + 'static,
    F: std::future::Future<Output = T> + Send + 'static,
{
    let mut wait = first;
    loop {
        match race.step_blocks(session, what, step()).await {
            Ok(waiting) => {
                assert_eq!(waiting.blocked_by(), [holder], "{what}");
                return waiting.resume().await.unwrap();
            }
            Err(pgonce_testkit::HarnessError::DidNotBlock { .. })
                if wait < std::time::Duration::from_secs(16) =>
            {
                eprintln!(
                    "{what}: over before it was seen waiting, {timeout} {wait:?}: again, twice as long"
                );
                wait *= 2;
                let value = format!("{}ms", wait.as_millis());
                session.set(timeout, &value).await.unwrap();
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// The id the server's next transaction will get: no transaction has
/// taken it, or any later one.
pub async fn next_xid(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A harness on the database `options` points to, with a session named
/// `pass` whose default isolation level is REPEATABLE READ (as `ALTER
/// DATABASE ... SET default_transaction_isolation` gives every new one)
/// and a session named `writer` at the server's default.
pub async fn pass_and_writer(
    options: sqlx::postgres::PgConnectOptions,
    pass: &str,
    writer: &str,
) -> (
    pgonce_testkit::Interleaving,
    pgonce_testkit::Session,
    pgonce_testkit::Session,
) {
    let race = pgonce_testkit::Interleaving::new(options).await.unwrap();
    let pass = race.session(pass).await.unwrap();
    let writer = race.session(writer).await.unwrap();
    pass.set("default_transaction_isolation", "repeatable read")
        .await
        .unwrap();
    (race, pass, writer)
}

/// Drives one of the library's passes into a row change committed after
/// its statement began, under a stricter default isolation than READ
/// COMMITTED: `pass` (whose statement `pass_session` has run once already,
/// so that it is prepared and its next run binds before it locks) is seen
/// blocked behind `writer`'s lock on `table`, taken with the uncommitted
/// `change`; then `writer` commits and `pass` goes on. Run at the database's
/// default level, the pass's snapshot predates the change and meeting the
/// changed row is a serialization failure (40001); at READ COMMITTED it
/// re-reads the row, or skips it. Returns what `pass` returned.
pub async fn pass_meeting_a_committed_change<T: Send + 'static>(
    race: &pgonce_testkit::Interleaving,
    pass_session: &pgonce_testkit::Session,
    writer: &pgonce_testkit::Session,
    table: &str,
    change: &str,
    pass: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let mut tx = pgonce::begin(writer.pool(), pgonce::IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    let lock = format!("LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE");
    race.step(
        writer,
        &lock,
        sqlx::query(sqlx::AssertSqlSafe(lock.clone())).execute(&mut *tx),
    )
    .await
    .unwrap()
    .unwrap();
    race.step(
        writer,
        change,
        sqlx::query(sqlx::AssertSqlSafe(change.to_owned())).execute(&mut *tx),
    )
    .await
    .unwrap()
    .unwrap();
    let waiting = race.step_blocks(pass_session, "pass", pass).await.unwrap();
    assert_eq!(waiting.blocked_by(), [writer.name()]);
    race.step(writer, "COMMIT", tx.commit())
        .await
        .unwrap()
        .unwrap();
    waiting.resume().await.unwrap()
}

/// What a pooled connection carries over from its last use, as the next
/// user of the pool sees it.
#[derive(Debug, PartialEq, Eq)]
pub struct Leftovers {
    /// Inside a transaction block begun before this statement.
    pub in_transaction: bool,
    /// Advisory locks its backend holds.
    pub advisory_locks: i64,
}

impl Leftovers {
    /// A connection fit for its next user: no transaction, no lock.
    pub const NONE: Leftovers = Leftovers {
        in_transaction: false,
        advisory_locks: 0,
    };
}

/// What the connection `pool` hands out next carries over. A simple query
/// (one message): outside a transaction block it is the first command of
/// its own transaction, where `statement_timestamp()` and
/// `transaction_timestamp()` are the same; a row lock can only be held
/// inside a block, so none is left when there is none.
pub async fn leftovers(pool: &sqlx::PgPool) -> Leftovers {
    use sqlx::Row;
    let row = sqlx::raw_sql(
        "SELECT statement_timestamp() <> transaction_timestamp(), \
         (SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    Leftovers {
        in_transaction: row.get(0),
        advisory_locks: row.get(1),
    }
}

/// Gives up `waiting`, a step of `waiter` seen blocked by `holder`'s
/// transaction, as a caller whose client went away would; then ends that
/// transaction (`end`: its commit or rollback), and checks that `waiter`'s
/// one connection, once the given-up step is done with it, carries
/// nothing over to its next user.
pub async fn give_up_then_end<T, R, E: Into<pgonce_testkit::BoxError>>(
    race: &pgonce_testkit::Interleaving,
    waiting: pgonce_testkit::Blocked<T>,
    (holder, end): (
        &pgonce_testkit::Session,
        impl std::future::Future<Output = Result<R, E>>,
    ),
    waiter: &pgonce_testkit::Session,
) {
    assert_eq!(waiting.blocked_by(), [holder.name()]);
    waiting.cancel();
    race.try_step(holder, "end", end).await.unwrap();
    assert_eq!(
        race.step(waiter, "next use", leftovers(waiter.pool()))
            .await
            .unwrap(),
        Leftovers::NONE
    );
}

/// Two sessions of a race: A holds a lock in a transaction it keeps open,
/// B is to wait for it.
pub struct HolderAndWaiter {
    pub race: pgonce_testkit::Interleaving,
    pub a: pgonce_testkit::Session,
    pub b: pgonce_testkit::Session,
    pub tx_a: sqlx::Transaction<'static, sqlx::Postgres>,
}

/// Sessions A and B on the database `options` points to, A having run
/// `lock` (a statement that takes a lock, `what` for the timeline) in a
/// transaction it keeps open.
pub async fn a_holding(
    options: sqlx::postgres::PgConnectOptions,
    what: &str,
    lock: &'static str,
) -> HolderAndWaiter {
    let race = pgonce_testkit::Interleaving::new(options).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let mut tx_a = a.pool().begin().await.unwrap();
    race.try_step(&a, what, sqlx::query(lock).execute(&mut *tx_a))
        .await
        .unwrap();
    HolderAndWaiter { race, a, b, tx_a }
}
