//! The notifier's pass against a real PostgreSQL and a local webhook
//! receiver: a job that fails on its own does not cost the others of the
//! pass their sending or their count.

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
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        notifier
            .run(async {
                let _ = stopped.await;
            })
            .await
    });
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
    let expected_key = pgonce_incidents::notifier::idempotency_key(incidents[0].id);
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
