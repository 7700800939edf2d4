//! While the database cannot be reached, `/readyz` answers 503 within a
//! second and API calls fail with 503 `unavailable` within the pool's
//! acquire timeout, instead of waiting for a connection that will not come.

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use pgonce::PgQueue;
use pgonce_incidents::api::{ApiConfig, ApiState, router};
use pgonce_incidents::runtime::observations_queue;
use pgonce_incidents::{Service, ServiceConfig};
use pgonce_testkit::{Cluster, FaultProxy, NewConnections, ScratchDatabase};
use serde_json::Value;
use sqlx::Connection;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

/// GET `path`: the answer's status and JSON body, which must come within
/// `within`. The bound is a timer of the test's runtime, not a reading of
/// the clock once the answer is in: the service's own waits
/// (`READY_WITHIN`, the pool's acquire timeout) are timers of that
/// runtime too, so a machine too busy to run the runtime for a while makes
/// both late alike, and the request, polled first, ends at its own. One
/// that truly waits past the bound (for a connection that will not come)
/// fails whatever the machine's speed.
async fn get(router: &axum::Router, path: &str, within: Duration) -> (StatusCode, Value) {
    let request = Request::get(path)
        // Well formed, so that checking it needs the database.
        .header(
            header::AUTHORIZATION,
            format!("Bearer pgo_{}_{}", "a".repeat(12), "b".repeat(64)),
        )
        .body(Body::empty())
        .unwrap();
    let response = tokio::time::timeout(within, router.clone().oneshot(request))
        .await
        .unwrap_or_else(|_| panic!("{path} unanswered within {within:?}"))
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, body)
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

    let (status, _) = get(&router, "/readyz", Duration::from_secs(60)).await;
    assert_eq!(status, StatusCode::OK);

    cluster.stop();

    let (status, body) = get(&router, "/readyz", Duration::from_secs(1)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "unavailable", "{body}");

    let within = ACQUIRE_TIMEOUT + Duration::from_secs(1);
    let (status, body) = get(&router, "/v1/incidents", within).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
}

/// A session PostgreSQL ended, whatever the reason, is `unavailable`
/// (503, try again), not `internal`: its transaction rolled back, and a
/// new connection serves the retry. Ended for idling in a transaction past
/// `idle_in_transaction_session_timeout` (FATAL 25P03) and for idling past
/// `idle_session_timeout` (FATAL 57P05), each set to a millisecond for one
/// session; the test waits until the session is gone from
/// `pg_stat_activity`, then uses it. Both read as `internal` when only
/// connection exceptions and shutdowns counted.
#[tokio::test]
async fn a_session_postgres_ended_for_idling_is_unavailable() {
    let db = pgonce_testkit::fresh_database().await;
    let pool = db.pool(2).await.unwrap();
    for (setting, in_transaction) in [
        ("idle_in_transaction_session_timeout", true),
        ("idle_session_timeout", false),
    ] {
        let mut conn = sqlx::postgres::PgConnection::connect_with(&db.options())
            .await
            .unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        if in_transaction {
            sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
        }
        sqlx::query(sqlx::AssertSqlSafe(format!("SET {setting} = '1ms'")))
            .execute(&mut conn)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(60), async {
            while sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)",
            )
            .bind(pid)
            .fetch_one(&pool)
            .await
            .unwrap()
            {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the server ends the idle session");
        let ended = sqlx::query("SELECT 1")
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert!(pgonce::error::session_ended(&ended), "{setting}: {ended:?}");
        let error = pgonce_incidents::error::Error::from(pgonce::Error::from(ended));
        assert_eq!(error.code(), "unavailable", "{setting}: {error:?}");
    }
}

/// POST a declaration with `key`: the answer's status and JSON body.
async fn declare(router: &axum::Router, key: &str) -> (StatusCode, Value) {
    let request = Request::post("/v1/incidents")
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Body::from(r#"{"title": "disk on db-1"}"#))
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A fresh database migrated for the service, a pool of 4 on it, and its
/// observations queue.
async fn migrated_with_queue() -> (ScratchDatabase, sqlx::PgPool, PgQueue) {
    let (db, pool) = pgonce_testkit::fresh_migrated_database(4, pgonce_incidents::migrate).await;
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    (db, pool, queue)
}

/// The API of a service on `pool`, its observations sent to `queue`.
fn api_on(pool: sqlx::PgPool, queue: &PgQueue) -> axum::Router {
    let service = Service::new(pool, ServiceConfig::default()).unwrap();
    router(ApiState::new(service, queue.clone(), None, ApiConfig::default()).unwrap())
}

/// A pool on `db` whose sessions refuse writes, as on a server put
/// read-only: `default_transaction_read_only` on.
async fn read_only_pool(db: &ScratchDatabase) -> sqlx::PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            db.options()
                .options([("default_transaction_read_only", "on")]),
        )
        .await
        .unwrap()
}

/// A database that refuses a write for now is `unavailable` (503, retry
/// later), not `internal`: a read-only one (SQLSTATE 25006, a standby or a
/// server put read-only for maintenance: here the sessions'
/// `default_transaction_read_only`), and one short of a resource (class
/// 53: disk full, out of memory, too many connections, a configured
/// limit), which PostgreSQL reports as a plain ERROR that ends no session.
/// The resource errors are raised by a trigger on the incidents table, with
/// the codes PostgreSQL gives them. Nothing is written, and once the
/// database takes writes again the same request succeeds. Each read as
/// `internal` (500) when only unreachable databases and ended sessions
/// counted.
#[tokio::test]
async fn a_database_that_refuses_writes_for_now_is_unavailable() {
    let (db, pool) = pgonce_testkit::fresh_migrated_database(4, pgonce_incidents::migrate).await;
    let (_, key) = pgonce_incidents::store::create_organization(&pool, "acme")
        .await
        .unwrap();
    // The queue is created (written) before the service's pool is
    // anything but writable.
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let api = |service_pool: sqlx::PgPool| api_on(service_pool, &queue);
    let incidents = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM incidents.incidents")
            .fetch_one(&pool)
            .await
            .unwrap()
    };

    let read_only = read_only_pool(&db).await;
    let (status, body) = declare(&api(read_only), &key).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "read-only: {body}");
    assert_eq!(body["error"]["code"], "unavailable", "read-only: {body}");
    assert_eq!(incidents().await, 0);

    let router = api(pool.clone());
    let execute = async |sql: String| {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    };
    for code in [
        "disk_full",
        "out_of_memory",
        "too_many_connections",
        "configuration_limit_exceeded",
    ] {
        execute(format!(
            "CREATE OR REPLACE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS \
             $$BEGIN RAISE EXCEPTION 'refused by the test' USING ERRCODE = '{code}'; END$$"
        ))
        .await;
        execute(
            "CREATE OR REPLACE TRIGGER refuse BEFORE INSERT ON incidents.incidents \
             FOR EACH ROW EXECUTE FUNCTION public.refuse()"
                .into(),
        )
        .await;
        let (status, body) = declare(&router, &key).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{code}: {body}");
        assert_eq!(body["error"]["code"], "unavailable", "{code}: {body}");
        assert_eq!(incidents().await, 0, "{code}");
    }

    execute("DROP TRIGGER refuse ON incidents.incidents".into()).await;
    let (status, body) = declare(&router, &key).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["number"], 1, "{body}");
}

/// A database that refuses writes is not ready: `/readyz` answers 503
/// `unavailable`, naming why, where every write would answer 503 (SQLSTATE
/// 25006). Read-only here through the sessions'
/// `default_transaction_read_only` (as a server, a database or a role put
/// read-only for maintenance has it); a standby has `transaction_read_only`
/// on too, and `pg_is_in_recovery()` names it. The probe reads both in its
/// one statement and writes nothing. Once the sessions take writes the
/// same service is ready. It answered 200 `ready` when only an answer of
/// the database counted.
#[tokio::test]
async fn a_database_that_refuses_writes_is_not_ready() {
    let (db, pool, queue) = migrated_with_queue().await;
    let api = |service_pool: sqlx::PgPool| api_on(service_pool, &queue);
    let within = Duration::from_secs(60);

    let read_only = read_only_pool(&db).await;
    let (status, body) = get(&api(read_only), "/readyz", within).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("read-only"), "{message}");

    let (status, body) = get(&api(pool), "/readyz", within).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "ready", "{body}");
}

/// A service still running when a newer build migrates its database
/// (during a rolling deploy, or by `pgonce migrate` of the newer build)
/// stays ready: were every old process unready at that instant, the load
/// balancer would send the whole traffic to the one new process that
/// migrated. A process refuses a newer schema at start only.
#[tokio::test]
async fn a_database_a_newer_build_migrated_while_running_stays_ready() {
    let (_db, pool, queue) = migrated_with_queue().await;
    let api = api_on(pool.clone(), &queue);
    let within = Duration::from_secs(60);
    let (status, body) = get(&api, "/readyz", within).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    for version in [998_i64, 1998] {
        sqlx::query(
            "INSERT INTO _sqlx_migrations \
             (version, description, success, checksum, execution_time) \
             VALUES ($1, 'from a newer build', true, '\\x00', 0)",
        )
        .bind(version)
        .execute(&pool)
        .await
        .unwrap();
        let (status, body) = get(&api, "/readyz", within).await;
        assert_eq!(status, StatusCode::OK, "{version}: {body}");
        assert_eq!(body["status"], "ready", "{body}");
        sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
            .bind(version)
            .execute(&pool)
            .await
            .unwrap();
    }
    let (status, body) = get(&api, "/readyz", within).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// Probes answering 503 one after the other (here the service's role may
/// no longer log in) are each counted in
/// `pgonce_incidents_not_ready_probes_total{reason}`; the log has the
/// first at warn with its error, the others at debug (with a warn line a
/// minute at most, bounded by the time the probes took), and, once a probe
/// answers 200 again, one info line saying after how many. Each was
/// logged at warn: a line per probe, every few seconds from each load
/// balancer, for as long as the database was away.
#[tokio::test]
async fn probes_answering_503_log_the_first_then_a_line_a_minute_then_the_recovery() {
    const ROLE: &str = "pgonce_unready_probe";
    const PROBES: u64 = 5;
    let (db, pool) = pgonce_testkit::fresh_migrated_database(4, pgonce_incidents::migrate).await;
    sqlx::query("CREATE ROLE pgonce_unready_probe LOGIN")
        .execute(&pool)
        .await
        .unwrap();
    let probing = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.options().username(ROLE))
        .await
        .unwrap();
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let rendered = recorder.handle();
    // The requests run on this thread, so their counters land here.
    let _local = metrics::set_default_local_recorder(&recorder);
    let service = Service::new(probing, ServiceConfig::default()).unwrap();
    let state = ApiState::new(service, queue, None, ApiConfig::default()).unwrap();
    let router = router(state);
    let logged = pgonce_testkit::logs::LogLines::default();
    let _logging = logged.capture();
    let within = Duration::from_secs(60);
    let (status, body) = get(&router, "/readyz", within).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    sqlx::query("ALTER ROLE pgonce_unready_probe NOLOGIN")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1")
        .bind(ROLE)
        .execute(&pool)
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    for _ in 0..PROBES {
        let (status, body) = get(&router, "/readyz", within).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    }
    let lasted = started.elapsed();
    sqlx::query("ALTER ROLE pgonce_unready_probe LOGIN")
        .execute(&pool)
        .await
        .unwrap();
    let (status, body) = get(&router, "/readyz", within).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let first = logged.assert_run_of_failures(
        PROBES,
        lasted,
        "not ready: the database does not answer",
        "still not ready",
        Some(&format!("ready again after {PROBES} probes answered 503")),
    );
    assert!(first.error.is_some(), "with its error: {first:?}");
    let counted =
        format!("pgonce_incidents_not_ready_probes_total{{reason=\"no_answer\"}} {PROBES}");
    let rendered = rendered.render();
    assert!(rendered.contains(&counted), "{counted} in:\n{rendered}");
}

/// A database down for ten minutes (a cluster of the test's own, stopped)
/// while a load balancer probes five seconds after each answer: about a
/// hundred probes answered 503 (each within `READY_WITHIN`), the first
/// logged at warn, then a warn line a minute at most saying
/// how many since when, the others at debug. Tokio's paused clock: the
/// bounds are read from that clock, not from how fast the machine runs.
#[tokio::test]
async fn a_database_down_for_ten_minutes_logs_a_not_ready_line_a_minute() {
    const OUTAGE: Duration = Duration::from_secs(600);
    const EVERY: Duration = Duration::from_secs(5);
    let (mut cluster, pool) =
        pgonce_testkit::own_migrated_cluster(4, ACQUIRE_TIMEOUT, pgonce_incidents::migrate).await;
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let router = api_on(pool, &queue);
    let (status, body) = get(&router, "/readyz", Duration::from_secs(60)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    cluster.stop();

    let logged = pgonce_testkit::logs::LogLines::default();
    let _logging = logged.capture();
    tokio::time::pause();
    let started = tokio::time::Instant::now();
    let mut probes = 0;
    while started.elapsed() < OUTAGE {
        let (status, body) = get(&router, "/readyz", Duration::from_secs(1)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        probes += 1;
        tokio::time::sleep(EVERY).await;
    }
    let first = logged.assert_run_of_failures(
        probes,
        started.elapsed(),
        "not ready: the database does not answer",
        "still not ready",
        None,
    );
    assert!(first.error.is_some(), "with its error: {first:?}");
    let still = logged.starting(tracing::Level::WARN, "still not ready");
    assert!(!still.is_empty(), "a line a minute while it goes on");
}

/// A probe whose connection takes longer to open than `READY_WITHIN` (a
/// distant server, TLS, a slow login, a loaded machine) answers 503, and
/// the connection it began opening still reaches the pool, where the next
/// probe finds it. Driven with a proxy that holds each new connection
/// until the test lets it through: the first probe's past its bound, and
/// none after it. Each probe dropped the connection it was opening when
/// its bound ran out and the next began another: when opening one took
/// longer than the bound, no probe ever answered 200, and a process that
/// nothing else kept connected (an API-only `serve`, which the load
/// balancer took out of its rotation) stayed unready for good.
#[tokio::test]
async fn a_connection_slower_to_open_than_a_probe_waits_serves_the_next_probe() {
    let (db, _pool, queue) = migrated_with_queue().await;
    let mut proxy = FaultProxy::start(db.options(), NewConnections::HandOver)
        .await
        .unwrap();
    // No connection yet, and a connect bounded by the pool far past the
    // probes' own bound.
    let probing = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(120))
        .connect_lazy_with(proxy.options());
    let router = api_on(probing.clone(), &queue);

    let (status, body) = get(&router, "/readyz", Duration::from_secs(60)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    // The connection the first probe began, let through; every later one
    // stays held.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let first = tokio::time::timeout_at(deadline, proxy.next_connection())
        .await
        .expect("waited two minutes for the first probe's connection")
        .forward();
    while probing.num_idle() == 0 && !first.has_ended() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited two minutes for the first connection to open or end"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        probing.num_idle(),
        1,
        "the connection the first probe began was dropped with it"
    );

    let (status, body) = get(&router, "/readyz", Duration::from_secs(60)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}
