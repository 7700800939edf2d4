//! The notifier's pass against a real PostgreSQL and a local webhook
//! receiver: a job that fails on its own does not cost the others of the
//! pass their sending or their count.

use pgonce::job::{self, NewJob};
use pgonce_incidents::model::{Declaration, Incident};
use pgonce_incidents::service::NOTIFY_JOB_KIND;
use pgonce_incidents::webhook::{ReceiverFaults, WebhookReceiver};
use pgonce_incidents::{Notifier, NotifierConfig, Service, ServiceConfig, store};
use pgonce_testkit::{ScratchDatabase, fresh_database};
use serde_json::json;
use sqlx::PgPool;

/// A migrated database where alice declared one incident per title in
/// organization `acme` (each with its notification job).
async fn declared(titles: &[&str]) -> (ScratchDatabase, PgPool, Service, Vec<Incident>) {
    let db = fresh_database().await;
    let pool = db.pool(10).await.unwrap();
    pgonce_incidents::migrate(&pool).await.unwrap();
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

    let receiver = WebhookReceiver::start(ReceiverFaults::default())
        .await
        .unwrap();
    let notifier = Notifier::new(&service, NotifierConfig::new(receiver.url())).unwrap();
    let counts = notifier.run_once().await.unwrap();
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
