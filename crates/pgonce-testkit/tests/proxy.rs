//! The fault proxy in front of the test server: each way of handling new
//! connections, the held answer, and what dropping the proxy closes.

use std::time::{Duration, Instant};

use pgonce_testkit::{FaultProxy, Forwarded, NewConnections, fresh_database};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::task::JoinHandle;

/// Whether a client's bytes hold a LISTEN statement.
fn a_listen(sent: &[u8]) -> bool {
    sent.windows(6).any(|w| w == b"LISTEN")
}

/// A connect through `options`, under way in a task of its own.
fn connecting(options: PgConnectOptions) -> JoinHandle<Result<PgConnection, sqlx::Error>> {
    tokio::spawn(async move { PgConnection::connect_with(&options).await })
}

/// Waits until `relay` has ended; fails after a minute.
async fn ended(relay: &Forwarded) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !relay.has_ended() {
        assert!(Instant::now() < deadline, "the relay still runs");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the backend `pid` has run `statement` and is idle: the
/// server has sent its answer.
async fn ran(plain: &PgPool, pid: i32, statement: &str) {
    loop {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1 AND query = $2")
                .bind(pid)
                .bind(statement)
                .fetch_optional(plain)
                .await
                .unwrap();
        if state.as_deref() == Some("idle") {
            return;
        }
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn a_handed_over_connection_is_refused_or_forwarded_as_the_test_says() {
    let db = fresh_database().await;
    let mut proxy = FaultProxy::start(db.options(), NewConnections::HandOver)
        .await
        .unwrap();

    let refused = connecting(proxy.options());
    proxy.next_connection().await.refuse();
    assert!(refused.await.unwrap().is_err(), "a refused connect fails");

    let connect = connecting(proxy.options());
    let held = proxy.next_connection().await;
    tokio::task::yield_now().await;
    assert!(!connect.is_finished(), "held: no login answered yet");
    let forwarded = held.forward();
    let mut conn = connect.await.unwrap().unwrap();
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(one, 1);
    assert!(!forwarded.has_ended());
    conn.close().await.unwrap();
    ended(&forwarded).await;
}

#[tokio::test]
async fn a_connection_forwarded_late_is_answered_no_sooner() {
    let db = fresh_database().await;
    let late = Duration::from_millis(300);
    let proxy = FaultProxy::start(db.options(), NewConnections::ForwardLate(late))
        .await
        .unwrap();
    let started = Instant::now();
    let mut conn = PgConnection::connect_with(&proxy.options()).await.unwrap();
    assert!(started.elapsed() >= late, "{:?}", started.elapsed());
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(one, 1);
}

/// The hold applies to the first connection whose client sends a match,
/// once: the server has run the LISTEN, its answer is not through until
/// released, and another connection's LISTEN meanwhile is answered. (The
/// LISTENs go as simple queries, as sqlx's `PgListener` sends them: one
/// message that the server runs at once.)
#[tokio::test]
async fn the_answer_to_a_matching_message_is_held_until_released() {
    let db = fresh_database().await;
    let plain = db.pool(2).await.unwrap();
    let proxy = FaultProxy::start(db.options(), NewConnections::Forward)
        .await
        .unwrap();
    let mut holding = PgConnection::connect_with(&proxy.options()).await.unwrap();
    let mut other = PgConnection::connect_with(&proxy.options()).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut holding)
        .await
        .unwrap();

    let held = proxy.hold_answer_to(a_listen);
    sqlx::query("SELECT 1").execute(&mut other).await.unwrap();
    let listening = tokio::spawn(async move {
        sqlx::raw_sql("LISTEN proxied")
            .execute(&mut holding)
            .await
            .map(|_| holding)
    });
    ran(&plain, pid, "LISTEN proxied").await;
    sqlx::raw_sql("LISTEN other")
        .execute(&mut other)
        .await
        .unwrap();
    assert!(!listening.is_finished(), "the answer is held");

    held.release();
    let mut holding = listening.await.unwrap().unwrap();
    let channels: Vec<String> = sqlx::query_scalar("SELECT pg_listening_channels()")
        .fetch_all(&mut holding)
        .await
        .unwrap();
    assert_eq!(channels, ["proxied"]);

    // A hold dropped before anything matched it holds nothing.
    drop(proxy.hold_answer_to(a_listen));
    sqlx::raw_sql("LISTEN again")
        .execute(&mut holding)
        .await
        .unwrap();
}

#[tokio::test]
async fn dropping_the_proxy_closes_every_connection_through_it() {
    let db = fresh_database().await;
    let mut proxy = FaultProxy::start(db.options(), NewConnections::HandOver)
        .await
        .unwrap();
    let connect = connecting(proxy.options());
    let forwarded = proxy.next_connection().await.forward();
    let mut conn = connect.await.unwrap().unwrap();
    let still_held = connecting(proxy.options());
    let address = proxy.address();

    drop(proxy);
    assert!(
        sqlx::query("SELECT 1").execute(&mut conn).await.is_err(),
        "the forwarded connection is closed"
    );
    ended(&forwarded).await;
    assert!(
        still_held.await.unwrap().is_err(),
        "the held connection is closed"
    );
    assert!(
        tokio::net::TcpStream::connect(address).await.is_err(),
        "the port refuses new connections"
    );
}
