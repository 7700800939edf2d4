//! Maintenance against a real PostgreSQL: per cleaner, rows past retention
//! go and rows inside it, or still live, stay; batches are bounded; a row a
//! concurrent transaction is changing is skipped, not waited for; `None`
//! keeps everything; a bad config deletes nothing.
//!
//! Ages are set by writing timestamps in the past: time passing is not what
//! these tests are about.

mod support;

use std::time::Duration;

use pgonce::Error;
use pgonce::maintenance::{self, CleanedCounts, Maintenance, MaintenanceConfig};
use pgonce_testkit::{Interleaving, TableLock, fresh_migrated_database};
use sqlx::PgPool;

async fn setup() -> (pgonce_testkit::ScratchDatabase, PgPool) {
    let (db, pool) = fresh_migrated_database(8, pgonce::migrate).await;
    (db, pool)
}

const HOUR: u64 = 3600;
const DAY: u64 = 24 * HOUR;

/// A job in `status`, created `age_secs` ago; a terminal one finished then.
async fn job(pool: &PgPool, status: &str, age_secs: u64) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO pgonce.jobs (kind, status, created_at, run_at, finished_at, \
                                  lease_token, lease_expires_at) \
         SELECT 'k', $1::text, t, \
                CASE WHEN $1 = 'failed' THEN now() + interval '1 hour' ELSE t END, \
                CASE WHEN $1 IN ('completed', 'dead') THEN t END, \
                CASE WHEN $1 = 'processing' THEN gen_random_uuid() END, \
                CASE WHEN $1 = 'processing' THEN now() + interval '1 hour' END \
         FROM (SELECT now() - make_interval(secs => $2) AS t) AS at \
         RETURNING id",
    )
    .bind(status)
    .bind(age_secs as f64)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[derive(sqlx::FromRow, Debug, PartialEq, Eq)]
struct JobRow {
    id: i64,
    status: String,
}

async fn jobs(pool: &PgPool) -> Vec<JobRow> {
    sqlx::query_as("SELECT id, status FROM pgonce.jobs ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn job_ids(pool: &PgPool) -> Vec<i64> {
    jobs(pool).await.into_iter().map(|j| j.id).collect()
}

/// Rows in `table` (a fixed name from these tests).
async fn count(pool: &PgPool, table: &'static str) -> i64 {
    let sql = format!("SELECT count(*) FROM {table}");
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn exec(pool: &PgPool, sql: &'static str) {
    sqlx::query(sql).execute(pool).await.unwrap();
}

/// One pass with the default retentions.
async fn default_pass(pool: &PgPool) -> CleanedCounts {
    maintenance::run_once(pool, &MaintenanceConfig::default())
        .await
        .unwrap()
}

/// One pass with the default retentions, and the one text column `sql`
/// selects afterwards.
async fn default_pass_leaving(pool: &PgPool, sql: &'static str) -> (CleanedCounts, Vec<String>) {
    let counts = default_pass(pool).await;
    (counts, texts(pool, sql).await)
}

/// The one text column `sql` selects, row by row.
async fn texts(pool: &PgPool, sql: &'static str) -> Vec<String> {
    sqlx::query_scalar(sql).fetch_all(pool).await.unwrap()
}

fn only(set: impl FnOnce(&mut MaintenanceConfig)) -> MaintenanceConfig {
    let mut config = MaintenanceConfig::keep_everything();
    set(&mut config);
    config
}

#[tokio::test]
async fn completed_jobs_past_retention_go_and_live_or_recent_jobs_stay() {
    let (_db, pool) = setup().await;
    let old_completed = job(&pool, "completed", 25 * HOUR).await;
    let recent_completed = job(&pool, "completed", HOUR).await;
    let pending = job(&pool, "pending", 30 * DAY).await;
    let processing = job(&pool, "processing", 30 * DAY).await;
    let failed = job(&pool, "failed", 30 * DAY).await;
    let dead = job(&pool, "dead", 2 * DAY).await;

    let counts = default_pass(&pool).await;

    assert_eq!(counts.completed_jobs, 1);
    assert_eq!(counts.dead_jobs, 0);
    let left = job_ids(&pool).await;
    assert!(!left.contains(&old_completed));
    assert_eq!(left, [recent_completed, pending, processing, failed, dead]);
}

#[tokio::test]
async fn dead_jobs_go_after_their_own_longer_retention_with_their_retry_audit() {
    let (_db, pool) = setup().await;
    let old_dead = job(&pool, "dead", 8 * DAY).await;
    let recent_dead = job(&pool, "dead", 6 * DAY).await;
    let old_completed = job(&pool, "completed", 30 * DAY).await;
    sqlx::query(
        "INSERT INTO pgonce.job_retries (job_id, retried_by, previous_attempts, dead_since) \
         VALUES ($1, 'ops', 5, now() - interval '9 days')",
    )
    .bind(old_dead)
    .execute(&pool)
    .await
    .unwrap();

    // Completed jobs kept forever: only the dead-job cleaner runs.
    let config = only(|c| c.dead_jobs = Some(Duration::from_secs(7 * DAY)));
    let counts = maintenance::run_once(&pool, &config).await.unwrap();

    assert_eq!(
        counts,
        CleanedCounts {
            dead_jobs: 1,
            batches: 1,
            ..CleanedCounts::default()
        }
    );
    let left = job_ids(&pool).await;
    assert_eq!(left, [recent_dead, old_completed]);
    assert_eq!(count(&pool, "pgonce.job_retries").await, 0);
}

async fn queue(pool: &PgPool, name: &str, dead_letter: Option<&str>) {
    sqlx::query(
        "INSERT INTO pgonce.queue (name, fifo, visibility_timeout_ms, retention_ms, delay_ms, \
                                   max_receive_count, dead_letter_queue, dedup_window_ms) \
         VALUES ($1, false, 30000, 1209600000, 0, $3, $2, 300000)",
    )
    .bind(name)
    .bind(dead_letter)
    .bind(dead_letter.map(|_| 3))
    .execute(pool)
    .await
    .unwrap();
}

/// A message in `queue`, sent `age_secs` ago, visible after `visible_in_secs`
/// (negative: already), moved there from `from` by the dead-letter rule.
async fn message(
    pool: &PgPool,
    queue: &str,
    from: Option<&str>,
    age_secs: u64,
    visible_in_secs: f64,
) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO pgonce.queue_message (queue, body, sent_at, visible_at, dead_lettered_from) \
         VALUES ($1, 'm', now() - make_interval(secs => $2), \
                 now() + make_interval(secs => $3), $4) \
         RETURNING id",
    )
    .bind(queue)
    .bind(age_secs as f64)
    .bind(visible_in_secs)
    .bind(from)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn dead_letter_messages_go_after_retention_unless_in_flight_and_other_queues_are_untouched() {
    let (_db, pool) = setup().await;
    queue(&pool, "orders-dlq", None).await;
    queue(&pool, "orders", Some("orders-dlq")).await;
    let old_dead_lettered = message(&pool, "orders-dlq", Some("orders"), 15 * DAY, -1.0).await;
    let recent_dead_lettered = message(&pool, "orders-dlq", Some("orders"), 13 * DAY, -1.0).await;
    let old_in_flight = message(&pool, "orders-dlq", Some("orders"), 15 * DAY, 60.0).await;
    let old_ordinary = message(&pool, "orders", None, 15 * DAY, -1.0).await;

    let counts = default_pass(&pool).await;

    assert_eq!(counts.dead_letter_messages, 1);
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM pgonce.queue_message ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(!left.contains(&old_dead_lettered));
    assert_eq!(left, [recent_dead_lettered, old_in_flight, old_ordinary]);
}

#[tokio::test]
async fn dedup_claims_go_once_their_window_ended_and_live_ones_stay() {
    let (_db, pool) = setup().await;
    queue(&pool, "q", None).await;
    exec(
        &pool,
        "INSERT INTO pgonce.queue_dedup (queue, dedup_id, message_id, expires_at) VALUES \
         ('q', 'ended', 1, now() - interval '1 second'), \
         ('q', 'live', 2, now() + interval '5 minutes')",
    )
    .await;

    let (counts, left) = default_pass_leaving(
        &pool,
        "SELECT dedup_id FROM pgonce.queue_dedup ORDER BY dedup_id",
    )
    .await;
    assert_eq!(counts.queue_dedup, 1);
    assert_eq!(left, ["live"]);

    // A grace period keeps ended claims that long.
    exec(
        &pool,
        "INSERT INTO pgonce.queue_dedup (queue, dedup_id, message_id, expires_at) \
         VALUES ('q', 'ended-recently', 3, now() - interval '10 minutes')",
    )
    .await;
    let graced = only(|c| c.queue_dedup = Some(Duration::from_secs(HOUR)));
    assert_eq!(
        maintenance::run_once(&pool, &graced)
            .await
            .unwrap()
            .queue_dedup,
        0
    );
    assert_eq!(count(&pool, "pgonce.queue_dedup").await, 2);
}

#[tokio::test]
async fn idempotency_keys_go_after_retention_but_never_while_held() {
    let (_db, pool) = setup().await;
    exec(
        &pool,
        "INSERT INTO pgonce.idempotency_keys \
             (scope, key, fingerprint, status, hold_token, held_until, response, created_at, finished_at) \
         VALUES \
         ('s', 'old-done',      '\\x01', 'done', NULL, NULL, '{}', now() - interval '25 hours', now() - interval '25 hours'), \
         ('s', 'recent-done',   '\\x01', 'done', NULL, NULL, '{}', now() - interval '1 hour', now() - interval '1 hour'), \
         ('s', 'old-held',      '\\x01', 'in_progress', gen_random_uuid(), now() + interval '1 minute', NULL, now() - interval '25 hours', NULL), \
         ('s', 'old-abandoned', '\\x01', 'in_progress', gen_random_uuid(), now() - interval '1 minute', NULL, now() - interval '25 hours', NULL)",
    )
    .await;

    let (counts, left) = default_pass_leaving(
        &pool,
        "SELECT key FROM pgonce.idempotency_keys ORDER BY key",
    )
    .await;
    assert_eq!(counts.idempotency_keys, 2);
    assert_eq!(left, ["old-held", "recent-done"]);
}

#[tokio::test]
async fn processed_message_keys_go_after_retention() {
    let (_db, pool) = setup().await;
    exec(
        &pool,
        "INSERT INTO pgonce.processed_messages (consumer, message_id, processed_at) VALUES \
         ('c', 'old', now() - interval '8 days'), \
         ('c', 'recent', now() - interval '6 days')",
    )
    .await;

    let (counts, left) =
        default_pass_leaving(&pool, "SELECT message_id FROM pgonce.processed_messages").await;
    assert_eq!(counts.processed_messages, 1);
    assert_eq!(left, ["recent"]);
}

#[tokio::test]
async fn a_pass_deletes_in_bounded_batches_until_one_comes_back_short() {
    let (_db, pool) = setup().await;
    for _ in 0..35 {
        job(&pool, "completed", 2 * DAY).await;
    }
    let live = job(&pool, "completed", HOUR).await;
    let config = only(|c| {
        c.completed_jobs = Some(Duration::from_secs(24 * HOUR));
        c.batch_size = 10;
    });

    let counts = maintenance::run_once(&pool, &config).await.unwrap();

    // 10 + 10 + 10 + 5: the short fourth batch ends the cleaner.
    assert_eq!(
        counts,
        CleanedCounts {
            completed_jobs: 35,
            batches: 4,
            ..CleanedCounts::default()
        }
    );
    let left = job_ids(&pool).await;
    assert_eq!(left, [live]);
}

#[tokio::test]
async fn keeping_everything_deletes_nothing_however_old() {
    let (_db, pool) = setup().await;
    job(&pool, "completed", 365 * DAY).await;
    job(&pool, "dead", 365 * DAY).await;
    exec(
        &pool,
        "INSERT INTO pgonce.processed_messages (consumer, message_id, processed_at) \
         VALUES ('c', 'm', now() - interval '365 days')",
    )
    .await;

    let counts = maintenance::run_once(&pool, &MaintenanceConfig::keep_everything())
        .await
        .unwrap();

    assert_eq!(counts, CleanedCounts::default());
    assert_eq!(count(&pool, "pgonce.jobs").await, 2);
    assert_eq!(count(&pool, "pgonce.processed_messages").await, 1);
}

#[tokio::test]
async fn a_bad_config_is_refused_before_anything_is_deleted() {
    let (_db, pool) = setup().await;
    job(&pool, "completed", 30 * DAY).await;
    let config = MaintenanceConfig {
        batch_size: 0,
        ..MaintenanceConfig::default()
    };

    // A retention whose cutoff falls before PostgreSQL's first timestamp
    // (4713 BC) would fail every pass: refused up front.
    let too_long = MaintenanceConfig {
        completed_jobs: Some(maintenance::MAX_RETENTION + Duration::from_secs(1)),
        ..MaintenanceConfig::default()
    };
    for config in [config, too_long] {
        let err = maintenance::run_once(&pool, &config).await.unwrap_err();
        assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
        assert!(matches!(
            Maintenance::spawn(pool.clone(), config).unwrap_err(),
            Error::Invalid { .. }
        ));
    }
    assert_eq!(count(&pool, "pgonce.jobs").await, 1);
    // The longest retention runs, and keeps the 30-day-old job.
    let longest = MaintenanceConfig {
        completed_jobs: Some(maintenance::MAX_RETENTION),
        ..MaintenanceConfig::default()
    };
    maintenance::run_once(&pool, &longest).await.unwrap();
    assert_eq!(count(&pool, "pgonce.jobs").await, 1);
}

/// An operator retries a dead job past retention (A: the row is locked and
/// pending, uncommitted) while the cleaner runs (B). The cleaner must
/// neither wait for A nor delete the job: it takes the other expired dead
/// job and leaves this one. Once A commits, the job is pending: live, and
/// the next pass leaves it too.
#[tokio::test]
async fn a_dead_job_being_retried_is_skipped_not_waited_for_and_then_kept() {
    let (db, pool) = setup().await;
    let retried = job(&pool, "dead", 30 * DAY).await;
    let untouched = job(&pool, "dead", 30 * DAY).await;
    let race = Interleaving::new(db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    let config = only(|c| c.dead_jobs = Some(Duration::from_secs(7 * DAY)));

    let mut tx_a = a.pool().begin().await.unwrap();
    race.step(
        &a,
        "retry the dead job (uncommitted)",
        sqlx::query(
            "UPDATE pgonce.jobs SET status = 'pending', finished_at = NULL, attempts = 0, \
                    run_at = now() \
             WHERE id = $1 AND status = 'dead'",
        )
        .bind(retried)
        .execute(&mut *tx_a),
    )
    .await
    .unwrap()
    .unwrap();

    // If the cleaner waited on A's lock, this step would time out.
    let counts = race
        .step(
            &b,
            "maintenance pass",
            maintenance::run_once(b.pool(), &config),
        )
        .await
        .expect("the cleaner waited for a row another transaction holds")
        .unwrap();
    assert_eq!(counts.dead_jobs, 1);
    assert_eq!(
        jobs(&pool).await,
        [JobRow {
            id: retried,
            status: "dead".into()
        }],
        "the locked job stays, the other expired one ({untouched}) is gone"
    );

    race.step(&a, "COMMIT", tx_a.commit())
        .await
        .unwrap()
        .unwrap();
    let again = race
        .step(&b, "next pass", maintenance::run_once(b.pool(), &config))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.dead_jobs, 0);
    assert_eq!(
        jobs(&pool).await,
        [JobRow {
            id: retried,
            status: "pending".into()
        }]
    );
}

#[tokio::test]
async fn the_spawned_loop_cleans_and_stops_when_asked() {
    let (_db, pool) = setup().await;
    job(&pool, "completed", 30 * DAY).await;
    let live = job(&pool, "pending", 30 * DAY).await;
    let handle = Maintenance::spawn(pool.clone(), MaintenanceConfig::default()).unwrap();

    // The first pass runs at once; wait for its effect, not for a time.
    let mut passes = 0;
    while count(&pool, "pgonce.jobs").await > 1 {
        passes += 1;
        assert!(passes < 600, "the loop never deleted the expired job");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    handle.stop().await;
    let left = job_ids(&pool).await;
    assert_eq!(left, [live]);
}

/// The loop's next pass is due an interval after the last, and tokio
/// clamps a timer's deadline to one it can keep: an interval of
/// `Duration::MAX` is taken, runs the first pass, then waits, and stops on
/// shutdown like any other.
#[tokio::test]
async fn the_longest_interval_runs_its_first_pass_and_stops_on_shutdown() {
    let (_db, pool) = setup().await;
    job(&pool, "completed", 30 * DAY).await;
    let config = MaintenanceConfig {
        interval: Duration::MAX,
        ..MaintenanceConfig::default()
    };
    let handle = Maintenance::spawn(pool.clone(), config).unwrap();
    // Poll the database for the outcome (no sleep decides anything).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while count(&pool, "pgonce.jobs").await != 0 {
        assert!(std::time::Instant::now() < deadline, "no first pass");
        tokio::task::yield_now().await;
    }
    tokio::time::timeout(Duration::from_secs(60), handle.stop())
        .await
        .expect("the loop stops on shutdown");
}

/// The cleaners' deletes ran alone on the pool, at the database's default
/// level: under REPEATABLE READ, an old completed job changed after the
/// statement's snapshot (here put back to pending by hand) was a
/// serialization failure and the pass failed. At READ COMMITTED the
/// cleaner re-reads the row, finds it no longer completed, and keeps it.
#[tokio::test]
async fn a_cleaner_under_a_stricter_default_isolation_keeps_a_row_changed_meanwhile() {
    let (db, pool) = setup().await;
    let id = job(&pool, "pending", 30 * DAY).await;
    let config = MaintenanceConfig {
        completed_jobs: Some(Duration::from_secs(DAY)),
        dead_jobs: None,
        queue_dedup: None,
        dead_letter_messages: None,
        idempotency_keys: None,
        processed_messages: None,
        ..MaintenanceConfig::default()
    };
    let (race, passer, writer) =
        support::pass_and_writer(db.options(), "maintenance", "operator").await;
    let first = maintenance::run_once(passer.pool(), &config).await.unwrap();
    assert_eq!(first.completed_jobs, 0);
    exec(
        &pool,
        "UPDATE pgonce.jobs SET status = 'completed', finished_at = now() - interval '30 days'",
    )
    .await;
    let pass_pool = passer.pool().clone();
    let out = support::pass_meeting_a_committed_change(
        &race,
        &passer,
        &writer,
        "pgonce.jobs",
        &format!("UPDATE pgonce.jobs SET status = 'pending', finished_at = NULL WHERE id = {id}"),
        async move { maintenance::run_once(&pass_pool, &config).await },
    )
    .await;
    assert_eq!(out.unwrap().completed_jobs, 0);
    assert_eq!(
        jobs(&pool).await,
        [JobRow {
            id,
            status: "pending".to_string()
        }]
    );
}

/// Stopping the spawned loop drops a pass in progress at its current
/// statement, each a transaction of its own: a pass whose delete is seen
/// blocked on a table lock the test holds (a migration's, a `VACUUM
/// FULL`'s) lets `stop` return while the lock is still held. (`stop`
/// waited for the whole pass, for as long as the lock was held.)
#[tokio::test]
async fn stopping_the_loop_drops_a_pass_blocked_on_a_lock() {
    let (_db, pool) = setup().await;
    let old = job(&pool, "completed", 30 * DAY).await;
    let lock = TableLock::take(&pool, "pgonce.jobs").await.unwrap();
    let handle = Maintenance::spawn(pool.clone(), MaintenanceConfig::default()).unwrap();
    // The first pass runs at once: wait until its delete waits on the lock.
    lock.wait_until_blocking(&pool, 1, Duration::from_secs(20))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), handle.stop())
        .await
        .expect("stop waited for the pass blocked on the lock");
    lock.release().await.unwrap();
    // Whatever the dropped statement did, it did in a transaction of its
    // own: the row is there or gone, never half; a later pass deletes it.
    maintenance::run_once(&pool, &MaintenanceConfig::default())
        .await
        .unwrap();
    assert!(!job_ids(&pool).await.contains(&old));
}
