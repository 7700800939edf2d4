//! While the database cannot be reached, `/readyz` answers 503 within a
//! second and API calls fail with 503 `unavailable` within the pool's
//! acquire timeout, instead of waiting for a connection that will not come.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use pgonce_incidents::api::{ApiConfig, ApiState, router};
use pgonce_incidents::runtime::observations_queue;
use pgonce_incidents::{Service, ServiceConfig};
use pgonce_testkit::Cluster;
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

async fn get(router: &axum::Router, path: &str) -> (StatusCode, Value, Duration) {
    let request = Request::get(path)
        // Well formed, so that checking it needs the database.
        .header(
            header::AUTHORIZATION,
            format!("Bearer pgo_{}_{}", "a".repeat(12), "b".repeat(64)),
        )
        .body(Body::empty())
        .unwrap();
    let started = Instant::now();
    let response = router.clone().oneshot(request).await.unwrap();
    let elapsed = started.elapsed();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, body, elapsed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_database_is_unready_at_once_and_unavailable_to_api_calls() {
    // A cluster of its own, to stop.
    let mut cluster = Cluster::start().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(&cluster.url("postgres"))
        .await
        .unwrap();
    pgonce_incidents::migrate(&pool).await.unwrap();
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let state = ApiState::new(service, queue, None, ApiConfig::default()).unwrap();
    let router = router(state);

    let (status, _, _) = get(&router, "/readyz").await;
    assert_eq!(status, StatusCode::OK);

    cluster.stop();

    let (status, body, elapsed) = get(&router, "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    assert!(elapsed < Duration::from_secs(1), "/readyz took {elapsed:?}");

    let (status, body, elapsed) = get(&router, "/v1/incidents").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    assert!(
        elapsed < ACQUIRE_TIMEOUT + Duration::from_secs(1),
        "an API call took {elapsed:?}"
    );
}
