//! A connection pooler set up wrongly is named, not hidden: through a
//! PgBouncer in transaction mode without `max_prepared_statements`, the
//! library returns [`pgonce::Error::Pooler`] naming the cause and the fix,
//! and the HTTP API answers 503 `pooler` with that text, never 500
//! `internal`.
//!
//! The failure is made certain, not left to chance: every sqlx connection
//! names its first prepared statement `sqlx_s_1`, and PgBouncer hands a
//! client the server connection released last. So one client prepares
//! `sqlx_s_1` on a server connection and stays connected; the next client's
//! first statement lands on that same server connection, where `sqlx_s_1`
//! already exists.

use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use pgonce::PoolerProblem;
use pgonce_incidents::api::{ApiConfig, ApiState, router};
use pgonce_incidents::runtime::observations_queue;
use pgonce_incidents::{Service, ServiceConfig, store};
use pgonce_testkit::{Pooler, PoolerSetup, ScratchDatabase, fresh_database, shared_for_tests};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgPoolOptions, Postgres};
use tower::ServiceExt;

const ADMIN: &str = "test-admin-token-0123456789";

/// A migrated fresh database, a PgBouncer without `max_prepared_statements`
/// in front of its server, and a pool through it.
async fn behind_a_misconfigured_pooler() -> (ScratchDatabase, Pooler, PgPool) {
    let db = fresh_database().await;
    let direct = db.pool(1).await.unwrap();
    pgonce_incidents::migrate(&direct).await.unwrap();
    direct.close().await;
    let server = shared_for_tests().unwrap();
    let pooler = Pooler::start_with(server.options(), PoolerSetup::NoPreparedStatements).unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(pooler.options(db.name()))
        .await
        .unwrap();
    (db, pooler, pool)
}

/// A client that prepares `sqlx_s_1` on a server connection and stays
/// connected (idle, so the pooler has the server connection back). Its
/// own statement may fail (the server connection may already hold the
/// name); the name is on the server connection either way.
async fn prepare_and_hold(pool: &PgPool) -> PoolConnection<Postgres> {
    let mut first = pool.acquire().await.unwrap();
    let _ = sqlx::query("SELECT 1").execute(&mut *first).await;
    first
}

fn assert_names_the_prepared_statements_fix(text: &str) {
    assert!(
        text.contains("prepared statements") && text.contains("max_prepared_statements"),
        "{text}"
    );
    assert!(
        text.contains("sqlx_s_1"),
        "the pooler's own message: {text}"
    );
    assert!(!text.contains('\n'), "one line: {text}");
}

#[tokio::test]
async fn without_max_prepared_statements_the_library_returns_a_typed_pooler_error() {
    let (_db, _pooler, pool) = behind_a_misconfigured_pooler().await;
    let _held = prepare_and_hold(&pool).await;
    let err = store::create_organization(&pool, "acme")
        .await
        .expect_err("sqlx_s_1 already exists on the server connection");
    let pgonce_incidents::Error::Pgonce(pgonce::Error::Pooler { problem, message }) = &err else {
        panic!("expected a pooler error, got {err:?}");
    };
    assert_eq!(*problem, PoolerProblem::PreparedStatements);
    assert!(message.contains("SQLSTATE 42P05"), "{message}");
    assert_eq!(err.code(), "pooler");
    let text = err.to_string();
    assert_names_the_prepared_statements_fix(&text);
    // Printed the way the command prints errors (the error and each of its
    // sources, joined), the pooler's message appears once.
    let mut printed = text.clone();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        printed = format!("{printed}: {cause}");
        source = cause.source();
    }
    assert_eq!(printed.matches("sqlx_s_1").count(), 1, "{printed}");
}

#[tokio::test]
async fn without_max_prepared_statements_the_api_answers_503_pooler() {
    let (db, _pooler, pool) = behind_a_misconfigured_pooler().await;
    // The queue through a direct pool: this test is about the service's
    // calls through the pooler.
    let direct = db.pool(2).await.unwrap();
    let queue = observations_queue(&direct, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let config = ApiConfig {
        admin_token: Some(ADMIN.into()),
        ..ApiConfig::default()
    };
    let app = router(ApiState::new(service, queue, None, config).unwrap());
    let _held = prepare_and_hold(&pool).await;
    let request = Request::builder()
        .method(Method::POST)
        .uri("/v1/organizations")
        .header(header::AUTHORIZATION, format!("Bearer {ADMIN}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({ "name": "acme" }).to_string()))
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "pooler", "{body}");
    assert_names_the_prepared_statements_fix(body["error"]["message"].as_str().unwrap());
    let created: i64 = sqlx::query_scalar("SELECT count(*) FROM incidents.organizations")
        .fetch_one(&direct)
        .await
        .unwrap();
    assert_eq!(created, 0, "nothing half written");
}
