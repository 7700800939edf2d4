//! The incident service run under faults ([`pgonce_lab::incident_run`]) against a real
//! PostgreSQL: observations on the FIFO queue with duplicate sends, a
//! visibility timeout shorter than some evaluations, a webhook receiver
//! that fails and answers late, one worker runtime (with the notifier)
//! killed mid-run, and, in one test, the database server restarted
//! mid-run. Afterwards I1, I2, I3 and I6 hold in the database. Also: the
//! settle phase finishes notifications a stopped notifier left behind; the
//! demo's verdict tells pending work (a run that could not finish) from
//! violations; a fatal error still ends in one report.

use std::collections::BTreeSet;
use std::time::Duration;

use pgonce::job::{self, RetryPolicy};
use pgonce_incidents::invariants::NotNotifiedOnce;
use pgonce_incidents::model::Declaration;
use pgonce_incidents::runtime::observations_queue;
use pgonce_incidents::service::NOTIFY_JOB_KIND;
use pgonce_incidents::{Service, ServiceConfig, store};
use pgonce_lab::demo;
use pgonce_lab::incident_run::{
    self, DeliveryAudit, IncidentRunConfig, NotificationAudit, NotificationJob, Retrier,
};
use pgonce_lab::report::{Environment, Report};
use pgonce_lab::scratch::RunDatabase;
use pgonce_testkit::webhook::{ReceiverFaults, WebhookReceiver};
use pgonce_testkit::{fresh_database, fresh_migrated_database};

/// Guarded (rollout 100): every invariant holds although messages are
/// delivered twice, concurrently, and a worker process dies.
#[tokio::test]
async fn the_pipeline_keeps_every_invariant_under_redelivery_and_a_killed_worker() {
    let db = fresh_database().await;
    let pool = db.pool(30).await.unwrap();
    let outcome = incident_run::run(&pool, &IncidentRunConfig::quick(), None, None)
        .await
        .unwrap();
    assert!(outcome.drained && outcome.settled, "{outcome:#?}");
    assert!(outcome.all_hold(), "{outcome:#?}");
    assert!(outcome.tallies.incidents > 0);
    assert_eq!(outcome.tallies.notifications, outcome.tallies.incidents);
    assert_eq!(
        outcome.receiver.accepted as i64, outcome.tallies.incidents,
        "one accepted key per incident"
    );
    assert!(outcome.workers.received > 0);
}

/// The server restarts (fast shutdown: every session cut off) while the
/// pipeline runs; the run's drivers retry, the workers recover, and every
/// invariant is checked and holds afterwards.
#[tokio::test]
async fn the_incident_run_survives_a_database_restart_mid_run() {
    // A cluster of its own: the shared test server must not restart under
    // the other tests.
    let db = RunDatabase::open(None, "incident_run_restart", 40)
        .await
        .unwrap();
    let pool = db.pool().clone();
    let started_at = || async {
        sqlx::query_scalar::<_, f64>(
            "SELECT extract(epoch FROM pg_postmaster_start_time())::float8",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = started_at().await;
    let mut config = IncidentRunConfig::quick();
    config.observations = 400;
    let restarter = db.restarter().expect("a throwaway cluster");
    let outcome = incident_run::run(
        &pool,
        &config,
        Some((Duration::from_millis(500), restarter)),
        None,
    )
    .await
    .unwrap();
    let restart = outcome.restart.clone().expect("asked for");
    assert_eq!(restart.error, None);
    assert!(started_at().await > before, "the server did restart");
    assert!(outcome.all_hold(), "{outcome:#?}");
    assert!(outcome.tallies.incidents > 0);
    assert_eq!(outcome.tallies.notifications, outcome.tallies.incidents);
    db.close().await.unwrap();
}

/// A slow machine is not a broken pipeline: the drain deadline counts
/// from the last progress, never from the start. Here the run cannot end
/// within its deadline by construction, however fast the machine (one
/// entity, so one FIFO group and one message in flight at a time, and
/// every evaluation takes at least 200 ms: 100 observations need at least
/// 20 s), yet it moves every few hundred milliseconds, so it drains and
/// every invariant holds. Against a deadline counted from the start (the
/// demo failed its verdict so on a loaded machine, every invariant intact)
/// it never drained.
#[tokio::test]
async fn a_run_slower_than_its_deadline_drains_while_it_makes_progress() {
    let db = fresh_database().await;
    let pool = db.pool(30).await.unwrap();
    let mut config = IncidentRunConfig::quick();
    config.entities = 1;
    config.observations = 100;
    config.runtime.evaluator.latency = Duration::from_millis(200);
    config.runtime.evaluator.jitter = Duration::ZERO;
    config.runtime.evaluator.slow_rate = 0.0;
    config.drain_deadline = Duration::from_secs(8);
    let floor = config.runtime.evaluator.latency * config.observations as u32;
    assert!(floor > config.drain_deadline * 2);
    let outcome = incident_run::run(&pool, &config, None, None).await.unwrap();
    assert!(outcome.elapsed > config.drain_deadline, "{outcome:#?}");
    assert!(outcome.drained && outcome.settled, "{outcome:#?}");
    assert!(outcome.all_hold(), "{outcome:#?}");
    assert_eq!(outcome.tallies.notifications, outcome.tallies.incidents);
}

/// A notification that is never delivered (dead after its one attempt)
/// does not keep the run waiting: the people keep declaring incidents
/// until the drain ends, and their notifications kept going out, which the
/// drain counted as progress for ever (a CI run waited out the test's 900 s
/// so). The run ends, settled, and I3 names every dead notification.
#[tokio::test]
async fn a_notification_that_dies_ends_the_run_with_i3_failing_not_a_wait() {
    let db = fresh_database().await;
    let pool = db.pool(30).await.unwrap();
    let mut config = IncidentRunConfig::quick();
    config.notify_max_attempts = 1;
    config.receiver.fail_rate = 0.5;
    let outcome = tokio::time::timeout(
        Duration::from_secs(600),
        incident_run::run(&pool, &config, None, None),
    )
    .await
    .expect("the run ends")
    .unwrap();
    assert!(outcome.drained && outcome.settled, "{outcome:#?}");
    let dead = &outcome.notifications.never_enqueued_or_lost;
    assert!(!dead.is_empty(), "{outcome:#?}");
    assert!(
        dead.iter()
            .all(|(_, job)| job.as_ref().is_some_and(|j| j.status == "dead")),
        "{dead:#?}"
    );
    assert!(!outcome.all_hold());
}

/// Notifications a stopped notifier left behind (one claimed under a lease
/// nobody will complete, one failed and waiting for its retry) are
/// finished by the settle phase: it runs the reaper and the re-driver with
/// the notifier, which alone would leave both unfinished.
#[tokio::test]
async fn settling_finishes_claimed_and_failed_notifications() {
    let (_db, pool) = fresh_migrated_database(20, pgonce_incidents::migrate).await;
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let (org, _) = store::create_organization(&pool, "acme").await.unwrap();
    for n in 0..2 {
        let d = Declaration {
            title: format!("by hand {n}"),
            entity: None,
            idempotency_key: None,
        };
        service.declare(org.id, &d, "on-call").await.unwrap();
    }
    // A notifier claims both, then stops: one send failed (backoff), the
    // other never finished (its lease runs out).
    let mut claimed = job::claim_batch(&pool, NOTIFY_JOB_KIND, 2, Duration::from_millis(500))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 2);
    let failed = claimed.pop().unwrap();
    let retry = RetryPolicy {
        base: Duration::from_millis(300),
        max: Duration::from_millis(300),
        jitter: 0.0,
    };
    job::fail(&pool, &failed.lease, "webhook answered 500", &retry)
        .await
        .unwrap();

    let receiver = WebhookReceiver::start(ReceiverFaults::default())
        .await
        .unwrap();
    let queue = observations_queue(&pool, Duration::from_secs(5), 5)
        .await
        .unwrap();
    let mut runtime = IncidentRunConfig::quick().runtime;
    runtime.notifier.as_mut().unwrap().webhook_url = receiver.url().to_owned();
    let settled = incident_run::settle(
        &service,
        &queue,
        &runtime,
        &[org.id],
        &Retrier::new(Duration::from_secs(5)),
    )
    .await
    .unwrap();
    let states: Vec<&str> = settled.jobs.iter().map(|j| j.status.as_str()).collect();
    assert!(settled.settled, "still pending: {:#?}", settled.jobs);
    assert_eq!(states, ["completed", "completed"]);
    assert_eq!(receiver.stats().accepted, 2);
    // The receiver's log names each incident once, from the bodies sent.
    let opened: Vec<i64> = settled.jobs.iter().map(|j| j.incident_id).collect();
    let deliveries = DeliveryAudit::of(&opened, &BTreeSet::new(), &receiver.accepted());
    assert!(deliveries.holds(), "{deliveries:#?}");
    assert_eq!((deliveries.incidents, deliveries.accepted), (2, 2));
}

fn not_once(incident_id: i64, notifications: i64, jobs: i64, completed: i64) -> NotNotifiedOnce {
    NotNotifiedOnce {
        incident_id,
        notifications,
        jobs,
        completed_jobs: completed,
    }
}

fn job(job_id: i64, incident_id: i64, status: &str) -> NotificationJob {
    NotificationJob {
        job_id,
        incident_id,
        status: status.into(),
        attempts: 2,
        max_attempts: 8,
        last_error: Some("webhook answered 500".into()),
        run_in_secs: Some(0.4),
        lease_left_secs: None,
    }
}

/// I3's audit tells three things apart: notified more than once and never
/// enqueued or lost (violations), and still pending at the deadline (a
/// failure that names the job, its state and why).
#[test]
fn notifications_pending_at_the_deadline_are_told_apart_from_violations() {
    let jobs = [
        job(41, 1, "completed"),
        job(42, 2, "failed"),
        job(43, 3, "dead"),
        job(44, 4, "completed"),
        job(45, 4, "completed"),
    ];
    let audit = NotificationAudit::classify(
        vec![
            not_once(2, 0, 1, 0),
            not_once(3, 0, 1, 0),
            not_once(4, 2, 2, 2),
            not_once(5, 0, 0, 0),
        ],
        &jobs,
    );
    assert_eq!(audit.pending_at_deadline, [job(42, 2, "failed")]);
    assert_eq!(audit.more_than_once, [not_once(4, 2, 2, 2)]);
    let lost: Vec<(i64, Option<i64>)> = audit
        .never_enqueued_or_lost
        .iter()
        .map(|(n, j)| (n.incident_id, j.as_ref().map(|j| j.job_id)))
        .collect();
    assert_eq!(lost, [(3, Some(43)), (5, None)]);
    assert!(!audit.holds());
    assert!(NotificationAudit::classify(Vec::new(), &jobs).holds());
}

/// The demo's verdict on a run whose only problem is a notification still
/// waiting for its retry: the run could not finish (exit 3), with the
/// pending job, its state and why, and no violation claimed.
#[tokio::test]
async fn the_demo_reports_a_pending_notification_as_unfinished_with_its_state() {
    let db = fresh_database().await;
    let pool = db.pool(30).await.unwrap();
    let mut outcome = incident_run::run(&pool, &IncidentRunConfig::quick(), None, None)
        .await
        .unwrap();
    assert!(outcome.all_hold(), "{outcome:#?}");
    let report = demo::render(&outcome, 100, Environment::unknown());
    assert!(report.verdict.ok, "{:?}", report.verdict);

    outcome.notifications.pending_at_deadline = vec![job(42, 2, "failed")];
    let report = demo::render(&outcome, 100, Environment::unknown());
    let unfinished = unfinished_not_violated(&report);
    assert_eq!(unfinished.len(), 1, "{unfinished:#?}");
    assert!(
        unfinished[0]
            .starts_with("UNFINISHED: I3: 1 notification jobs still pending at the deadline")
            && unfinished[0].contains("job 42 (incident 2): waiting for its retry"),
        "{}",
        unfinished[0]
    );
    assert!(
        report
            .verdict
            .reasons
            .iter()
            .any(|r| r.starts_with("ok: I3: 0 incidents never enqueued")),
        "{:?}",
        report.verdict
    );
    let listed = &report.sections["notifications pending at the deadline"];
    assert_eq!(listed.len(), 1);
}

/// A run whose pipeline stalls past its window with every invariant intact
/// could not finish; it did not fail. Here the stall is certain: a failed
/// delivery comes back only after 30 s, the window is 2 s, and the four
/// malformed messages fail every delivery, so they sit in the queue with
/// nothing else to move. The demo reported it FAILED, as it reports a
/// broken invariant, malformed messages still to be dead-lettered counted
/// as a violation too.
///
/// The visibility timeout is as long as the failures' and the receive
/// limit far above what the run can reach, whatever the machine's load:
/// with the quick run's 300 ms, a worker slowed past it by a busy machine
/// failed a malformed message on a receipt already stale, so the failure's
/// 30 s never applied, the message came back every 300 ms and reached the
/// dead-letter queue within the run.
#[tokio::test]
async fn a_run_that_stalls_with_every_invariant_intact_could_not_finish() {
    let db = fresh_database().await;
    let pool = db.pool(30).await.unwrap();
    let mut config = IncidentRunConfig::quick();
    config.observations = 60;
    config.visibility = Duration::from_secs(30);
    config.max_receive_count = 1000;
    config.runtime.worker.failure_visibility = Some(Duration::from_secs(30));
    config.runtime.evaluator.failure_rate = 0.0;
    config.drain_deadline = Duration::from_secs(2);
    let outcome = incident_run::run(&pool, &config, None, None).await.unwrap();
    assert!(!outcome.drained, "{outcome:#?}");
    assert_eq!(outcome.observations.malformed_dead_lettered, 0);
    let report = demo::render(&outcome, 100, Environment::unknown());
    let unfinished = unfinished_not_violated(&report);
    assert!(
        unfinished.iter().all(|r| r.starts_with("UNFINISHED: ")),
        "{unfinished:#?}"
    );
}

/// Asserts that `report`'s run could not finish and broke nothing; returns
/// the reasons that are not `ok:`.
fn unfinished_not_violated(report: &Report) -> Vec<&String> {
    let verdict = serde_json::to_value(&report.verdict).unwrap();
    assert_eq!(
        (&verdict["ok"], &verdict["finished"], &verdict["violated"]),
        (&false.into(), &false.into(), &false.into()),
        "{verdict:#}"
    );
    report
        .verdict
        .reasons
        .iter()
        .filter(|r| !r.starts_with("ok:"))
        .collect()
}

/// A fatal error (here: the server cannot be reached) still ends in a
/// report, printed as one JSON object with `--json`, whose verdict says
/// the run could not finish and why, claiming no violation.
#[tokio::test]
async fn a_fatal_error_still_ends_in_one_json_report() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        demo: demo::DemoArgs,
    }
    let cli = Cli::parse_from(["demo", "--observations", "10"]);
    let report = demo::run(&cli.demo, Some("postgres://postgres@127.0.0.1:1/absent"))
        .await
        .unwrap();
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["verdict"]["ok"], false);
    assert_eq!(json["verdict"]["finished"], false, "not a violation");
    assert_eq!(json["verdict"]["violated"], false);
    let reasons = json["verdict"]["reasons"].as_array().unwrap();
    assert_eq!(reasons.len(), 1);
    let reason = reasons[0].as_str().unwrap();
    assert!(
        reason.starts_with("UNFINISHED: the demo could not finish")
            && reason.contains("127.0.0.1:1"),
        "{reason}"
    );
}

/// The scratch database is dropped when a run ends on an error path (its
/// `RunDatabase` dropped without `close`), on an external server.
#[tokio::test]
async fn the_scratch_database_is_dropped_on_an_error_path() {
    let server = pgonce_testkit::shared_for_tests().unwrap();
    let o = server.options();
    let url = format!(
        "postgres://{}@{}:{}/{}",
        o.get_username(),
        o.get_host(),
        o.get_port(),
        o.get_database().unwrap_or("postgres")
    );
    let name = {
        let db = RunDatabase::open(Some(&url), "drop_check", 2)
            .await
            .unwrap();
        db.name().to_owned()
        // Dropped here, as a `?` or a Ctrl-C would.
    };
    let admin = fresh_database().await.pool(1).await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(&name)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(left, 0, "{name} left behind");
}

/// The drivers' retry: a session ended by the server (SQLSTATE 57P01, as
/// in a fast shutdown or restart) is retried and the call succeeds on a new
/// connection; a bad statement is not retried.
#[tokio::test]
async fn a_session_ended_by_the_server_is_retried_and_a_bad_statement_is_not() {
    let db = fresh_database().await;
    let pool = db.pool(2).await.unwrap();
    let retrier = Retrier::new(Duration::from_secs(10));
    let calls = std::sync::atomic::AtomicU32::new(0);
    let pid: i32 = retrier
        .run("reading the backend", || async {
            if calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0 {
                // The server ends this very session mid-call.
                sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                    .execute(&pool)
                    .await?;
            }
            sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                .fetch_one(&pool)
                .await
        })
        .await
        .unwrap();
    assert!(pid > 0);
    assert_eq!(retrier.retried(), 1);

    let err = retrier
        .run("a bad statement", || {
            sqlx::query("SELECT * FROM no_such_table").execute(&pool)
        })
        .await
        .unwrap_err();
    assert!(!incident_run::is_transient(&err), "{err:#}");
    assert_eq!(retrier.retried(), 1, "not retried");
}
