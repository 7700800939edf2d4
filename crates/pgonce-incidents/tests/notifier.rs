//! The notifier's pass against a real PostgreSQL and a local webhook
//! receiver: a job that fails on its own does not cost the others of the
//! pass their sending or their count; a notification's idempotency key is
//! its own, whichever database sent it.

use pgonce::job::{self, NewJob};
use pgonce_incidents::model::{Declaration, Incident};
use pgonce_incidents::notifier::NotifyCounts;
use pgonce_incidents::service::NOTIFY_JOB_KIND;
use pgonce_incidents::{Notifier, NotifierConfig, Service, ServiceConfig, store};
use pgonce_testkit::webhook::{ReceiverFaults, WebhookReceiver};
use pgonce_testkit::{ScratchDatabase, fresh_migrated_database};
use serde_json::json;
use sqlx::PgPool;

/// A migrated database where alice declared one incident per title in
/// organization `acme` (each with its notification job).
async fn declared(titles: &[&str]) -> (ScratchDatabase, PgPool, Service, Vec<Incident>) {
    let (db, pool) = fresh_migrated_database(10, pgonce_incidents::migrate).await;
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let (org, _) = store::create_organization(&pool, "acme").await.unwrap();
    let mut incidents = Vec::new();
    for title in titles {
        let d = Declaration {
            title: (*title).into(),
            entity: None,
            idempotency_key: None,
        };
        incidents.push(service.declare(org.id, &d, "alice").await.unwrap());
    }
    (db, pool, service, incidents)
}

/// One notifier pass against a receiver that answers every request.
async fn notify_once(service: &Service) -> NotifyCounts {
    let receiver = WebhookReceiver::start(ReceiverFaults::default())
        .await
        .unwrap();
    let notifier = Notifier::new(service, NotifierConfig::new(receiver.url())).unwrap();
    notifier.run_once().await.unwrap()
}

/// `notifier` running in a task of its own until the sender is used (or
/// dropped); the task returns what it sent.
fn run_until_stopped(
    notifier: Notifier,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<NotifyCounts>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        notifier
            .run(async {
                let _ = stopped.await;
            })
            .await
    });
    (stop, running)
}

/// The test kit's receiver deduplicates by the header the notifier sends;
/// the two crates name it each on its own.
#[test]
fn the_receiver_reads_the_header_the_notifier_sends() {
    assert_eq!(
        pgonce_testkit::webhook::IDEMPOTENCY_HEADER,
        pgonce_incidents::notifier::IDEMPOTENCY_HEADER
    );
}

#[tokio::test]
async fn a_job_that_fails_is_counted_and_the_rest_of_the_pass_is_sent() {
    let (_db, pool, service, incidents) = declared(&["db down", "queue stuck"]).await;
    // A second job for the first incident (a bug elsewhere): whichever of
    // the two records its notification second violates the primary key of
    // incidents.notifications, a database error inside that job only.
    job::enqueue(
        &pool,
        &NewJob::new(NOTIFY_JOB_KIND, json!({ "incident_id": incidents[0].id })),
    )
    .await
    .unwrap();

    let counts = notify_once(&service).await;
    assert_eq!((counts.sent, counts.errors), (2, 1), "{counts:?}");

    let notified: Vec<i64> =
        sqlx::query_scalar("SELECT incident_id FROM incidents.notifications ORDER BY 1")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(notified, [incidents[0].id, incidents[1].id], "one row each");
    let still_claimed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgonce.jobs WHERE status = 'processing'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(still_claimed, 1, "the failed job waits for the reaper");
}

/// The webhook client speaks TLS to an `https` URL: the receiver's first
/// bytes are a TLS handshake record (a ClientHello). This listener answers
/// nothing, so the send fails and is retried like any unreachable webhook.
#[tokio::test]
async fn an_https_webhook_gets_a_tls_handshake() {
    use tokio::io::AsyncReadExt;
    let (_db, _pool, service, _) = declared(&["db down"]).await;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let first_bytes = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut head = [0u8; 3];
        socket.read_exact(&mut head).await.unwrap();
        head
    });
    let mut config = NotifierConfig::new(format!("https://127.0.0.1:{port}/hook"));
    config.timeout = std::time::Duration::from_secs(2);
    let notifier = Notifier::new(&service, config).unwrap();
    let counts = notifier.run_once().await.unwrap();
    assert_eq!((counts.sent, counts.failed), (0, 1), "{counts:?}");
    // 0x16: handshake record; 0x03: TLS major version.
    let head = tokio::time::timeout(std::time::Duration::from_secs(5), first_bytes)
        .await
        .expect("the client never connected")
        .unwrap();
    assert_eq!(&head[..2], &[0x16, 0x03], "{head:?}");
}

/// I3 survives maintenance: once the finished notification jobs are
/// deleted, a delivered incident still holds I3 on its `notifications` row,
/// while an incident whose job died undelivered is still reported after its
/// dead job is gone too.
#[tokio::test]
async fn i3_holds_after_maintenance_deleted_finished_jobs_and_still_sees_an_undelivered_one() {
    use pgonce::maintenance::{self, MaintenanceConfig};
    use pgonce_incidents::invariants::{self, NotNotifiedOnce};

    let (_db, pool, service, incidents) = declared(&["db down", "queue stuck", "disk full"]).await;
    let org: i64 = sqlx::query_scalar("SELECT organization_id FROM incidents.incidents LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    let undelivered = incidents[2].id;
    // The third incident's job died before anything was sent (cancelled).
    sqlx::query(
        "UPDATE pgonce.jobs SET status = 'dead', finished_at = now(), last_error = 'cancelled' \
         WHERE kind = $1 AND (payload->>'incident_id')::bigint = $2",
    )
    .bind(NOTIFY_JOB_KIND)
    .bind(undelivered)
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(notify_once(&service).await.sent, 2);
    let missing = NotNotifiedOnce {
        incident_id: undelivered,
        notifications: 0,
        jobs: 1,
        completed_jobs: 0,
    };
    assert_eq!(
        invariants::not_notified_once(&pool, &[org]).await.unwrap(),
        std::slice::from_ref(&missing)
    );

    // A month later, maintenance removes the finished jobs.
    sqlx::query("UPDATE pgonce.jobs SET finished_at = now() - interval '30 days'")
        .execute(&pool)
        .await
        .unwrap();
    let cleaned = maintenance::run_once(&pool, &MaintenanceConfig::default())
        .await
        .unwrap();
    assert_eq!((cleaned.completed_jobs, cleaned.dead_jobs), (2, 1));

    assert_eq!(
        invariants::not_notified_once(&pool, &[org]).await.unwrap(),
        [NotNotifiedOnce { jobs: 0, ..missing }],
        "the delivered incidents hold I3; the undelivered one is still reported"
    );
}

/// A shutdown while a notification is being posted lets that pass finish:
/// the receiver already holds the notification, and a pass dropped there
/// would leave the job claimed, to be posted a second time after its lease.
#[tokio::test]
async fn a_shutdown_while_a_post_is_in_flight_records_what_was_delivered() {
    use std::time::Duration;
    let (_db, pool, service, incidents) = declared(&["db down"]).await;
    // Every request is accepted, then answered a second later: well within
    // the notifier's timeout, so the answer is a success.
    let receiver = WebhookReceiver::start(ReceiverFaults {
        late_rate: 1.0,
        late_by: Duration::from_secs(1),
        ..ReceiverFaults::default()
    })
    .await
    .unwrap();
    let mut config = NotifierConfig::new(receiver.url());
    config.timeout = Duration::from_secs(60);
    config.lease = Duration::from_secs(120);
    let notifier = Notifier::new(&service, config).unwrap();
    let (stop, run) = run_until_stopped(notifier);
    // The receiver holds the notification; its answer is on its way.
    tokio::time::timeout(Duration::from_secs(20), async {
        while receiver.stats().requests == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the notification reached the receiver");
    stop.send(()).unwrap();
    let counts = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("run returns after its pass")
        .unwrap();

    let status: String = sqlx::query_scalar("SELECT status FROM pgonce.jobs WHERE kind = $1")
        .bind(NOTIFY_JOB_KIND)
        .fetch_one(&pool)
        .await
        .unwrap();
    let recorded: Vec<i64> = sqlx::query_scalar("SELECT incident_id FROM incidents.notifications")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        (counts.sent, status.as_str(), recorded),
        (1, "completed", vec![incidents[0].id]),
        "{counts:?}"
    );
}

/// A webhook that answers a redirect has not received the notification:
/// following a 302 turns the POST into a GET without a body, whose 200
/// says nothing about the notification. The send fails, to be retried.
#[tokio::test]
async fn a_redirect_is_a_failed_send_not_a_delivery() {
    use axum::Router;
    use axum::http::{StatusCode, header};
    use axum::routing::{get, post};
    use std::sync::{Arc, Mutex};

    let (_db, pool, service, _) = declared(&["db down"]).await;
    let landed: Arc<Mutex<Vec<String>>> = Arc::default();
    let app = Router::new()
        .route(
            "/hook",
            post(|| async { (StatusCode::FOUND, [(header::LOCATION, "/landing")]) }),
        )
        .route(
            "/landing",
            get({
                let landed = landed.clone();
                move || async move {
                    landed.lock().unwrap().push("GET".into());
                    StatusCode::OK
                }
            })
            .post({
                let landed = landed.clone();
                move || async move {
                    landed.lock().unwrap().push("POST".into());
                    StatusCode::OK
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let notifier = Notifier::new(
        &service,
        NotifierConfig::new(format!("http://127.0.0.1:{port}/hook")),
    )
    .unwrap();
    let counts = notifier.run_once().await.unwrap();
    let recorded: i64 = sqlx::query_scalar("SELECT count(*) FROM incidents.notifications")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        (counts.sent, counts.failed, recorded),
        (0, 1, 0),
        "{counts:?}; the redirect target saw {:?}",
        landed.lock().unwrap()
    );
}

/// Two notifiers on one notification: the first one's POST is still in
/// flight when its lease runs out and the job is reaped; the second one
/// claims it, posts and completes. Both posts carry the same key, and the
/// first one's late completion is refused: one `notifications` row.
#[tokio::test]
async fn a_notifier_whose_lease_ran_out_mid_post_records_nothing() {
    use axum::Router;
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::post;
    use pgonce::job::{Reaper, ReaperConfig};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tokio::sync::Notify;

    /// Keys in arrival order; the first request waits for `release`.
    #[derive(Default)]
    struct Hook {
        keys: Mutex<Vec<String>>,
        arrived: Notify,
        release: Notify,
    }
    let (_db, pool, service, incidents) = declared(&["db down"]).await;
    let hook = Arc::new(Hook::default());
    let app = Router::new().route(
        "/hook",
        post({
            let hook = hook.clone();
            move |headers: HeaderMap| async move {
                let key = headers
                    .get("Idempotency-Key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let first = {
                    let mut keys = hook.keys.lock().unwrap();
                    keys.push(key);
                    keys.len() == 1
                };
                if first {
                    hook.arrived.notify_one();
                    hook.release.notified().await;
                }
                StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let mut config = NotifierConfig::new(format!("http://127.0.0.1:{port}/hook"));
    config.timeout = Duration::from_secs(60);
    config.lease = Duration::from_secs(120);
    let first = Notifier::new(&service, config.clone()).unwrap();
    let second = Notifier::new(&service, config).unwrap();

    let first_pass = tokio::spawn(async move { first.run_once().await });
    tokio::time::timeout(Duration::from_secs(20), hook.arrived.notified())
        .await
        .expect("the first POST arrived");
    // Its lease runs out while the POST is in flight; the reaper returns
    // the job, the second notifier sends it.
    sqlx::query("UPDATE pgonce.jobs SET lease_expires_at = now() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();
    let reaped = Reaper::new(pool.clone(), ReaperConfig::default())
        .unwrap()
        .run_once()
        .await
        .unwrap();
    assert_eq!(reaped.returned, 1);
    let second_counts = second.run_once().await.unwrap();
    hook.release.notify_one();
    let first_counts = first_pass.await.unwrap().unwrap();

    let recorded: Vec<i64> = sqlx::query_scalar("SELECT incident_id FROM incidents.notifications")
        .fetch_all(&pool)
        .await
        .unwrap();
    let keys = hook.keys.lock().unwrap().clone();
    let expected_key: String =
        sqlx::query_scalar("SELECT payload->>'idempotency_key' FROM pgonce.jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (
            second_counts.sent,
            first_counts.lease_lost,
            first_counts.sent
        ),
        (1, 1, 0),
        "{second_counts:?} {first_counts:?}"
    );
    assert_eq!(recorded, [incidents[0].id]);
    assert_eq!(keys, [expected_key.clone(), expected_key]);
}

/// A webhook URL may carry its receiver's secret (chat services put the
/// token in the path): a send that fails keeps and logs why without the
/// URL, whose path and query are the secret.
#[tokio::test]
async fn a_failed_send_keeps_its_reason_without_the_webhooks_secret() {
    let (_db, pool, service, _) = declared(&["db down"]).await;
    // A port nothing listens on: the connection is refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let url = format!("http://127.0.0.1:{port}/services/T0/B0/s3cr3t-t0ken?sig=s3cr3t-s1g");
    let notifier = Notifier::new(&service, NotifierConfig::new(url)).unwrap();
    let counts = notifier.run_once().await.unwrap();
    assert_eq!((counts.sent, counts.failed), (0, 1), "{counts:?}");
    let why: String = sqlx::query_scalar("SELECT last_error FROM pgonce.jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(why.starts_with("webhook unreachable: "), "{why}");
    assert!(!why.contains("s3cr3t"), "{why}");
    assert!(why.contains("Connection refused"), "says why: {why}");
}

/// A receiver answering 429 or 503 with `Retry-After` is retried no
/// sooner than it asked (in seconds or as an HTTP date), within the
/// policy's `max`: with the default backoff the eight attempts came within
/// about two minutes and the job died, never delivered, under a rate
/// limit of five. A `Retry-After` past `max`, or one that is neither
/// seconds nor a date, leaves the backoff as it was.
#[tokio::test]
async fn a_retry_after_is_waited_within_the_policys_max() {
    use std::time::{Duration, SystemTime};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let in_ten_minutes = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(600));
    // (status, Retry-After, least and most seconds until the retry; the
    // default policy: base 1 s, max 600 s, jitter 0.25).
    let cases = [
        ("429 Too Many Requests", "300", 299.0, 376.0),
        (
            "503 Service Unavailable",
            in_ten_minutes.as_str(),
            500.0,
            751.0,
        ),
        ("429 Too Many Requests", "999999999999", 599.0, 751.0),
        ("429 Too Many Requests", "soon", 0.0, 2.0),
        ("500 Internal Server Error", "300", 0.0, 2.0),
    ];
    for (status, retry_after, least, most) in cases {
        let (_db, pool, service, _) = declared(&["db down"]).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let answer = format!(
            "HTTP/1.1 {status}\r\nRetry-After: {retry_after}\r\ncontent-length: 0\r\n\
             connection: close\r\n\r\n"
        );
        let receiver = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await.unwrap();
            socket.write_all(answer.as_bytes()).await.unwrap();
        });
        let notifier = Notifier::new(
            &service,
            NotifierConfig::new(format!("http://127.0.0.1:{port}/hook")),
        )
        .unwrap();
        let counts = notifier.run_once().await.unwrap();
        receiver.await.unwrap();
        assert_eq!((counts.sent, counts.failed), (0, 1), "{status}: {counts:?}");
        let wait: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM run_at - now())::float8 FROM pgonce.jobs",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(
            (least..=most).contains(&wait),
            "{status}, Retry-After {retry_after}: retried in {wait} s"
        );
    }
}

/// A webhook URL whose scheme is written upper case is an http URL (a
/// scheme is case-insensitive): the configuration takes it, and the
/// notifier posts to it.
#[tokio::test]
async fn a_webhook_url_with_an_upper_case_scheme_is_taken_and_posted_to() {
    let (_db, _pool, service, _) = declared(&["db down"]).await;
    let receiver = WebhookReceiver::start(ReceiverFaults::default())
        .await
        .unwrap();
    let mut config = pgonce_incidents::config::Config::default();
    config.database.url = Some("postgres://x/y".into());
    config.notifier.webhook_url = Some(receiver.url().replacen("http://", "HTTP://", 1));
    config.validate().unwrap();
    let notifier = Notifier::new(&service, config.runtime_config().notifier.unwrap()).unwrap();
    let counts = notifier.run_once().await.unwrap();
    assert_eq!(counts.sent, 1, "{counts:?}");
    assert_eq!(receiver.stats().accepted, 1);
}

/// What a receiver does after it read the request decides the send, not
/// its body: a 200 whose body never ends is a delivery, recorded without
/// waiting for the body (the pass returns, well inside the send's
/// timeout of an hour here); a connection closed with no answer is a
/// failed send, retried with the same key.
#[tokio::test]
async fn a_receiver_is_judged_by_its_status_line_not_its_body() {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    // (what the receiver writes after reading the request, then holds the
    // connection open: true, or closes it: false; sent, failed)
    let cases = [
        (
            "HTTP/1.1 200 OK\r\ncontent-length: 1000000000000\r\n\r\nnever ends",
            true,
            (1, 0),
        ),
        ("", false, (0, 1)),
    ];
    for (answer, hold, expected) in cases {
        let (_db, pool, service, _) = declared(&["db down"]).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let receiver = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await.unwrap();
            socket.write_all(answer.as_bytes()).await.unwrap();
            if hold {
                let _ = released.await;
            }
        });
        let mut config = NotifierConfig::new(format!("http://127.0.0.1:{port}/hook"));
        config.timeout = Duration::from_secs(3600);
        config.lease = Duration::from_secs(7200);
        let notifier = Notifier::new(&service, config).unwrap();
        let counts = notifier.run_once().await.unwrap();
        assert_eq!(
            (counts.sent, counts.failed),
            expected,
            "{answer:?}: {counts:?}"
        );
        let recorded: i64 = sqlx::query_scalar("SELECT count(*) FROM incidents.notifications")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(recorded, expected.0 as i64, "{answer:?}");
        let _ = release.send(());
        receiver.await.unwrap();
    }
}

/// One request a [`RecordingHook`] received: the incident its body names
/// and the key its header carries.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Posted {
    incident_id: i64,
    key: String,
}

/// A receiver that records every request, answering 500 to the first
/// `refused` ones and 200 to the rest.
struct RecordingHook {
    url: String,
    posted: std::sync::Arc<std::sync::Mutex<Vec<Posted>>>,
}

impl RecordingHook {
    async fn start(refused: usize) -> RecordingHook {
        use axum::Router;
        use axum::http::{HeaderMap, StatusCode};
        use axum::routing::post;

        let posted: std::sync::Arc<std::sync::Mutex<Vec<Posted>>> = Default::default();
        let app = Router::new().route(
            "/hook",
            post({
                let posted = posted.clone();
                move |headers: HeaderMap, axum::Json(body): axum::Json<serde_json::Value>| async move {
                    let key = headers
                        .get(pgonce_incidents::notifier::IDEMPOTENCY_HEADER)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    let incident_id = body["incident_id"].as_i64().unwrap_or_default();
                    let mut posted = posted.lock().unwrap();
                    posted.push(Posted { incident_id, key });
                    if posted.len() <= refused {
                        StatusCode::INTERNAL_SERVER_ERROR
                    } else {
                        StatusCode::OK
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(listener, app).await });
        RecordingHook {
            url: format!("http://127.0.0.1:{port}/hook"),
            posted,
        }
    }

    /// What was posted, by incident, each incident's in arrival order.
    fn posted(&self) -> Vec<Posted> {
        let mut posted = self.posted.lock().unwrap().clone();
        posted.sort_by_key(|p| p.incident_id);
        posted
    }
}

/// The key a notification job's payload keeps, as the job table holds it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
struct KeptKey {
    incident_id: i64,
    idempotency_key: Option<String>,
}

async fn kept_keys(pool: &PgPool) -> Vec<KeptKey> {
    sqlx::query_as(
        "SELECT (payload->>'incident_id')::bigint AS incident_id, \
                payload->>'idempotency_key' AS idempotency_key \
           FROM pgonce.jobs WHERE kind = $1 ORDER BY 1",
    )
    .bind(NOTIFY_JOB_KIND)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// One pass of a notifier on each of `services`, in turn, posting to
/// `receiver`; each sends its one notification.
async fn each_notifies_once(services: &[&Service], receiver: &WebhookReceiver) {
    for service in services {
        let notifier = Notifier::new(service, NotifierConfig::new(receiver.url())).unwrap();
        let counts = notifier.run_once().await.unwrap();
        assert_eq!(counts.sent, 1, "{counts:?}");
    }
}

/// Two installations posting to one receiver: each database hands out
/// incident ids from 1, so their first incidents share an id. Each
/// notification is its own, and the receiver, which drops a key it has
/// already taken, takes both: with the key `incident-<id>` it dropped the
/// second installation's as a repeat of the first's, a notification seen
/// zero times.
#[tokio::test]
async fn two_databases_posting_to_one_receiver_are_both_taken() {
    let (_first_db, _, first, first_incidents) = declared(&["db down"]).await;
    let (_second_db, _, second, second_incidents) = declared(&["disk full"]).await;
    assert_eq!(
        first_incidents[0].id, second_incidents[0].id,
        "each database hands out the same first id"
    );
    let receiver = WebhookReceiver::start(ReceiverFaults::default())
        .await
        .unwrap();
    each_notifies_once(&[&first, &second], &receiver).await;
    let stats = receiver.stats();
    assert_eq!((stats.accepted, stats.duplicates), (2, 0), "{stats:?}");
}

/// A database restored from a backup taken before its latest incident
/// hands that incident's id out again, to another incident (the
/// sequence's state is the backup's): the incident notified before the
/// restore and the one created after it are two notifications, both
/// taken by the receiver, which with `incident-<id>` dropped the second.
/// The backup is a copy of the database (`CREATE DATABASE ... TEMPLATE`),
/// which is what restoring one gives.
#[tokio::test]
async fn a_database_restored_from_a_backup_notifies_an_id_it_hands_out_again() {
    let server = pgonce_testkit::server::shared_for_tests().unwrap();
    // The backup: the organization, no incident yet. A copy needs its
    // source without connections.
    let (live_db, backup_pool, _, _) = declared(&[]).await;
    backup_pool.close().await;
    let restored_name = format!("{}_restored", live_db.name());
    let admin = pgonce_testkit::fresh_database()
        .await
        .pool(1)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE \"{restored_name}\" TEMPLATE \"{}\"",
        live_db.name()
    )))
    .execute(&admin)
    .await
    .unwrap();

    let receiver = WebhookReceiver::start(ReceiverFaults::default())
        .await
        .unwrap();
    let mut ids = Vec::new();
    let mut pools = Vec::new();
    for (options, title) in [
        (live_db.options(), "db down"),
        (
            server.options().clone().database(&restored_name),
            "disk full",
        ),
    ] {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .unwrap();
        let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
        let org: i64 = sqlx::query_scalar("SELECT id FROM incidents.organizations")
            .fetch_one(&pool)
            .await
            .unwrap();
        let declaration = Declaration {
            title: title.into(),
            entity: None,
            idempotency_key: None,
        };
        ids.push(
            service
                .declare(org, &declaration, "alice")
                .await
                .unwrap()
                .id,
        );
        each_notifies_once(&[&service], &receiver).await;
        pools.push(pool);
    }
    for pool in pools {
        pool.close().await;
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{restored_name}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .unwrap();

    assert_eq!(
        ids[0], ids[1],
        "the restored database hands the id out again"
    );
    let stats = receiver.stats();
    assert_eq!((stats.accepted, stats.duplicates), (2, 0), "{stats:?}");
}

/// Every attempt of a notification sends the key drawn when its job was
/// enqueued, which its payload keeps, and no other notification sends it:
/// a POST answered 500 and its retry carry the same key, the key the
/// `notifications` row records; the other incident's notification carries
/// another.
#[tokio::test]
async fn a_retry_carries_the_key_its_jobs_payload_keeps() {
    use pgonce::job::{Redriver, RedriverConfig};

    let (_db, pool, service, incidents) = declared(&["db down", "queue stuck"]).await;
    let hook = RecordingHook::start(2).await;
    let notifier = Notifier::new(&service, NotifierConfig::new(hook.url.clone())).unwrap();
    let refused = notifier.run_once().await.unwrap();
    assert_eq!((refused.sent, refused.failed), (0, 2), "{refused:?}");
    // The retries are made due now rather than waited for.
    sqlx::query("UPDATE pgonce.jobs SET run_at = now() - interval '1 ms'")
        .execute(&pool)
        .await
        .unwrap();
    let redriven = Redriver::new(pool.clone(), RedriverConfig::default())
        .unwrap()
        .run_once()
        .await
        .unwrap();
    assert_eq!(redriven.redriven, 2);
    let retried = notifier.run_once().await.unwrap();
    assert_eq!(retried.sent, 2, "{retried:?}");

    let kept = kept_keys(&pool).await;
    assert!(
        kept.iter().all(|k| k.idempotency_key.is_some()),
        "every notification job keeps its key: {kept:?}"
    );
    let keys: Vec<String> = kept
        .iter()
        .filter_map(|k| k.idempotency_key.clone())
        .collect();
    assert_ne!(keys[0], keys[1], "each notification has its own key");
    for key in &keys {
        let uuid = uuid::Uuid::parse_str(key).unwrap();
        assert_eq!(uuid.get_version_num(), 4, "a random UUID: {key}");
    }
    let expected: Vec<Posted> = incidents
        .iter()
        .zip(&keys)
        .flat_map(|(incident, key)| {
            let posted = Posted {
                incident_id: incident.id,
                key: key.clone(),
            };
            [posted.clone(), posted]
        })
        .collect();
    assert_eq!(hook.posted(), expected, "a first attempt and its retry");
    let recorded: Vec<String> = sqlx::query_scalar(
        "SELECT idempotency_key FROM incidents.notifications ORDER BY incident_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(recorded, keys);
}

/// A notification job enqueued by a build before its payload kept a key
/// keeps sending that build's key, `incident-<id>`: the receiver may
/// already hold that build's POST of it, and drops the retry only by that
/// key. A job enqueued now, beside it, sends the key its payload keeps;
/// one whose kept key is not a UUID is a failed send naming the payload,
/// nothing posted.
#[tokio::test]
async fn a_job_enqueued_without_a_key_keeps_sending_the_incidents_key() {
    let (_db, pool, service, incidents) = declared(&["db down", "queue stuck", "disk full"]).await;
    let (old, new, garbled) = (incidents[0].id, incidents[1].id, incidents[2].id);
    // The first incident's job as the previous build enqueued it; the
    // third's key written by hand, wrongly.
    for (id, payload) in [
        (old, json!({ "incident_id": old })),
        (
            garbled,
            json!({ "incident_id": garbled, "idempotency_key": "incident-3" }),
        ),
    ] {
        sqlx::query(
            "UPDATE pgonce.jobs SET payload = $2 \
              WHERE kind = $1 AND (payload->>'incident_id')::bigint = $3",
        )
        .bind(NOTIFY_JOB_KIND)
        .bind(payload)
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    }
    let new_key = kept_keys(&pool).await[1].idempotency_key.clone();

    let hook = RecordingHook::start(0).await;
    let notifier = Notifier::new(&service, NotifierConfig::new(hook.url.clone())).unwrap();
    let counts = notifier.run_once().await.unwrap();
    assert_eq!((counts.sent, counts.failed), (2, 1), "{counts:?}");
    assert_eq!(
        hook.posted(),
        [
            Posted {
                incident_id: old,
                key: format!("incident-{old}"),
            },
            Posted {
                incident_id: new,
                key: new_key.unwrap_or_default(),
            },
        ]
    );
    let why: String = sqlx::query_scalar(
        "SELECT last_error FROM pgonce.jobs WHERE (payload->>'incident_id')::bigint = $1",
    )
    .bind(garbled)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(why.starts_with("malformed payload"), "{why}");
}

/// A notifier whose database is down (a server of the test's own,
/// stopped) backs off: its pause after a failed pass doubles from twice
/// `idle` up to `FAILED_PASSES_PAUSE_AT_MOST`, so that ten minutes of
/// outage see a few dozen passes at most; the log has the first failure
/// at warn with its error, then at most one warn line per minute, the
/// others at debug. Ten minutes of tokio's paused clock: the bounds are
/// read from that clock, not from how fast the machine runs. (A failed
/// pass was followed by `idle`, 100 ms, and logged at warn: about ten
/// lines a second for as long as the outage lasted.)
#[tokio::test]
async fn a_notifier_whose_database_is_down_backs_off_and_logs_a_line_a_minute() {
    use std::time::Duration;
    // A short acquire timeout: a pass against the stopped server fails
    // within it.
    let (mut cluster, pool) =
        pgonce_testkit::own_migrated_cluster(2, Duration::from_secs(1), pgonce_incidents::migrate)
            .await;
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let config = NotifierConfig::new("http://127.0.0.1:9/unused");
    let idle = config.idle;
    let notifier = Notifier::new(&service, config).unwrap();
    notifier
        .run_once()
        .await
        .expect("a pass while the server runs");
    cluster.stop();

    let logged = pgonce_testkit::logs::LogLines::default();
    let _logging = logged.capture();
    const OUTAGE: Duration = Duration::from_secs(600);
    tokio::time::pause();
    let (stop, running) = run_until_stopped(notifier);
    tokio::time::sleep(OUTAGE).await;
    stop.send(()).unwrap();
    let total = running.await.unwrap();
    assert_eq!(total, NotifyCounts::default(), "nothing sent");

    let first = logged.starting(tracing::Level::WARN, "notifier pass failed");
    assert_eq!(first.len(), 1, "the first failure alone at warn: {first:?}");
    assert!(first[0].error.is_some(), "with its error: {first:?}");
    let still = logged.starting(tracing::Level::WARN, "notifier passes still failing");
    let quiet = logged.starting(tracing::Level::DEBUG, "notifier pass failed");
    let passes = 1 + still.len() + quiet.len();
    let minutes = OUTAGE.as_secs() / 60;
    assert!(
        still.len() as u64 <= minutes,
        "one a minute at most, over {minutes} minutes: {}",
        still.len()
    );
    // How many failed passes the pauses leave room for in the outage,
    // each pause doubling from twice `idle` up to its bound; plus the
    // pass under way at its end.
    let mut room = 0;
    let mut paused = Duration::ZERO;
    let mut pause = idle;
    while paused <= OUTAGE {
        pause = (pause * 2).min(pgonce_incidents::notifier::FAILED_PASSES_PAUSE_AT_MOST);
        paused += pause;
        room += 1;
    }
    assert!(
        (2..=room).contains(&passes),
        "{passes} failed passes in {OUTAGE:?}, room for {room} with the backoff"
    );
    drop(cluster);
}

/// Waits (60 s at most, a failsafe, not a verdict) until `logged` holds
/// `at_least` lines of `level` starting with `start`.
async fn until_logged(
    logged: &pgonce_testkit::logs::LogLines,
    level: tracing::Level,
    start: &str,
    at_least: usize,
) {
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while logged.starting(level, start).len() < at_least {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("never logged {at_least} of {level} {start:?}"));
}

/// A notifier whose passes fail (its claims meet no jobs table, renamed
/// away) says once, at info, after how many failures a pass succeeded
/// again, and the run of failures is over: the next failure is the first
/// of a new run, at warn again (and its pause, counted from that run,
/// starts again from twice `idle`).
#[tokio::test]
async fn a_notifier_whose_passes_recover_says_so_once_and_starts_over() {
    let (_db, pool, service, _) = declared(&[]).await;
    let config = NotifierConfig {
        idle: std::time::Duration::from_millis(1),
        ..NotifierConfig::new("http://127.0.0.1:9/unused")
    };
    let notifier = Notifier::new(&service, config).unwrap();
    let logged = pgonce_testkit::logs::LogLines::default();
    let _logging = logged.capture();
    const AWAY: &str = "ALTER TABLE pgonce.jobs RENAME TO jobs_away";
    const BACK: &str = "ALTER TABLE pgonce.jobs_away RENAME TO jobs";
    let rename = async |statement: &'static str| {
        sqlx::query(statement).execute(&pool).await.unwrap();
    };
    rename(AWAY).await;
    let (stop, running) = run_until_stopped(notifier);
    use tracing::Level;
    until_logged(&logged, Level::DEBUG, "notifier pass failed", 2).await;
    rename(BACK).await;
    until_logged(&logged, Level::INFO, "notifier pass succeeded after", 1).await;
    rename(AWAY).await;
    until_logged(&logged, Level::WARN, "notifier pass failed", 2).await;
    rename(BACK).await;
    stop.send(()).unwrap();
    running.await.unwrap();

    let first = logged.starting(Level::WARN, "notifier pass failed");
    assert_eq!(first.len(), 2, "the first of each run at warn: {first:?}");
    let recovered = logged.starting(Level::INFO, "notifier pass succeeded after ");
    assert!(
        (1..=2).contains(&recovered.len()),
        "the recovery once per run (the second may end with the stop): {recovered:?}"
    );
    // "notifier pass succeeded after {n} failed passes since {when}"
    let failed: u64 = recovered[0]
        .message
        .trim_start_matches("notifier pass succeeded after ")
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count: {recovered:?}"));
    assert!(failed >= 3, "the first run's failures, counted: {failed}");
}
