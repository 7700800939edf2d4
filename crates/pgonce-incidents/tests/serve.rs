//! The API served over TCP by [`api::serve`]: what the HTTP layer does
//! before a handler runs. A client that sends part of its headers is
//! disconnected after the header timeout; one that announces a body and
//! sends less gets a JSON 408 after the body timeout; one that announces a
//! body over the limit gets a JSON 413 at once; one that stops reading its
//! answer is disconnected after the write timeout; and what hyper itself
//! refuses (a request it cannot parse, headers too large) is answered with
//! the API's JSON error body.

use std::time::Duration;

use pgonce_incidents::api::{self, ApiConfig, ApiState};
use pgonce_incidents::runtime::observations_queue;
use pgonce_incidents::{Service, ServiceConfig};
use pgonce_testkit::ScratchDatabase;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

struct Served {
    address: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    /// An organization's API key.
    key: String,
    pool: sqlx::PgPool,
    _db: ScratchDatabase,
}

const TIMEOUT: Duration = Duration::from_millis(300);

async fn serve() -> Served {
    let (db, pool) = pgonce_testkit::fresh_migrated_database(4, pgonce_incidents::migrate).await;
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let (_, key) = pgonce_incidents::store::create_organization(&pool, "acme")
        .await
        .unwrap();
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let config = ApiConfig {
        header_timeout: TIMEOUT,
        body_timeout: TIMEOUT,
        write_timeout: TIMEOUT,
        ..ApiConfig::default()
    };
    let state = ApiState::new(service, queue, None, config.clone()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let stopping = state.clone();
    let server = tokio::spawn(async move {
        api::serve(listener, api::router(state), &config, async move {
            let _ = stopped.await;
            stopping.stop_long_polls();
        })
        .await
    });
    Served {
        address,
        stop: Some(stop),
        server,
        key,
        pool,
        _db: db,
    }
}

impl Served {
    async fn stop(mut self) {
        self.stop.take().unwrap().send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), &mut self.server)
            .await
            .expect("the server stops")
            .unwrap()
            .unwrap();
    }
}

/// Everything the server sends until it closes the connection (bounded:
/// a server that never closes fails the test instead of hanging it).
async fn read_to_close(stream: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
        .await
        .expect("the server closes the connection")
        .ok();
    String::from_utf8_lossy(&out).into_owned()
}

/// One answer: its status and JSON body (the connection is closed after).
async fn exchange(address: std::net::SocketAddr, request: &[u8]) -> (u16, Value) {
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream.write_all(request).await.unwrap();
    let answer = read_to_close(&mut stream).await;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer: {answer:?}"));
    let status = head[9..12].parse().unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let body = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    (status, body)
}

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let served = serve().await;
    for partial in [&b""[..], b"GET /healthz HTTP/1.1\r\nHost: x\r\n"] {
        let mut stream = TcpStream::connect(served.address).await.unwrap();
        stream.write_all(partial).await.unwrap();
        let answer = read_to_close(&mut stream).await;
        assert_eq!(answer, "", "{partial:?}");
    }
    served.stop().await;
}

/// A client that takes none of a large answer's bytes is disconnected once
/// the write timeout runs out, instead of holding its connection, its task
/// and a graceful shutdown (which waits for every answer under way) for
/// ever.
#[tokio::test]
async fn a_client_that_stops_reading_its_answer_does_not_hold_the_server() {
    let served = serve().await;
    // An answer of about 18 MB, beyond what the two sockets' buffers hold.
    sqlx::query(
        "INSERT INTO incidents.entities (organization_id, external_id, attributes)
         SELECT o.id, 'e' || g, jsonb_build_object('big', repeat('x', 60000))
           FROM incidents.organizations o, generate_series(1, 300) g",
    )
    .execute(&served.pool)
    .await
    .unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(served.address).await.unwrap();
    let request = format!(
        "GET /v1/entities?limit=500 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
        served.key
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    // The answer has begun; the client reads no more of it.
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    served.stop().await;
}

/// A stop ends the long polls under way at once, each with an empty page
/// whose `next` is the position it asked from (the client asks again, of
/// another instance): a graceful stop waits for every answer under way,
/// and would otherwise wait out each poll's `wait`, up to `max_wait`,
/// before the runtime even began to stop.
#[tokio::test]
async fn a_stop_ends_the_long_polls_under_way() {
    let served = serve().await;
    let mut stream = TcpStream::connect(served.address).await.unwrap();
    let request = format!(
        "GET /v1/events?after=0&wait=30 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Authorization: Bearer {}\r\n\r\n",
        served.key
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    // The poll is under way once it has read the feed's horizon.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let polled: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_stat_activity
                             WHERE pid <> pg_backend_pid()
                               AND query LIKE '%pg_snapshot_xmin(pg_current_snapshot())%')",
        )
        .fetch_one(&served.pool)
        .await
        .unwrap();
        if polled {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the poll never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    served.stop().await;
    let answer = read_to_close(&mut stream).await;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{answer}");
    let body: Value = serde_json::from_str(body).unwrap();
    assert_eq!(body, serde_json::json!({"events": [], "next": 0}));
}

#[tokio::test]
async fn a_body_that_does_not_arrive_is_a_json_408_and_one_over_the_limit_a_json_413() {
    let served = serve().await;
    let request = |length: usize| {
        format!(
            "POST /v1/entities HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Authorization: Bearer {}\r\nContent-Length: {length}\r\n\r\n\
             {{\"external_id\": \"a\"}}",
            served.key
        )
    };
    // 20 bytes of the 1000 announced, then nothing: 408 once the body
    // timeout runs out, not an answer never given.
    let (status, body) = exchange(served.address, request(1000).as_bytes()).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (408, Some("request_timeout")),
        "{body}"
    );
    // 100 MB announced: refused before reading.
    let (status, body) = exchange(served.address, request(100_000_000).as_bytes()).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (413, Some("payload_too_large")),
        "{body}"
    );
    // The whole body: served.
    let (status, body) = exchange(served.address, request(20).as_bytes()).await;
    assert_eq!(status, 200, "{body}");
    served.stop().await;
}

/// A request head (request line and headers) of `len` bytes: a `GET
/// /healthz` padded with one header.
fn head_of(len: usize) -> Vec<u8> {
    let mut head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: ".to_vec();
    head.resize(len - 4, b'a');
    head.extend(b"\r\n\r\n");
    assert_eq!(head.len(), len);
    head
}

/// A head of `MAX_HEAD` bytes is served, and one a byte longer is 431,
/// sent in one write: the read buffer's bound alone (`max_buf_size`) let
/// a head that arrived at once through past it. A request target too long
/// for the head is 431 too.
#[tokio::test]
async fn a_head_over_max_head_is_431_even_sent_at_once() {
    let served = serve().await;
    let (status, body) = exchange(served.address, &head_of(api::MAX_HEAD)).await;
    assert_eq!(status, 200, "{body}");
    let mut long_target = b"GET /".to_vec();
    long_target.resize(70_000, b'a');
    long_target.extend(b" HTTP/1.1\r\nHost: x\r\n\r\n");
    for request in [
        head_of(api::MAX_HEAD + 1),
        head_of(80 * 1024),
        head_of(100 * 1024),
        long_target,
    ] {
        let (status, body) = exchange(served.address, &request).await;
        let refused = (status, body["error"]["code"].as_str());
        let len = request.len();
        assert_eq!(
            refused,
            (431, Some("header_fields_too_large")),
            "{len} bytes"
        );
    }
    served.stop().await;
}

#[tokio::test]
async fn what_hyper_refuses_gets_the_json_error_body() {
    let served = serve().await;
    let (status, body) = exchange(served.address, b"NOT HTTP AT ALL\r\n\r\n").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("bad_request"))
    );
    let mut huge = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 2 * api::MAX_HEAD));
    huge.extend(b"\r\n\r\n");
    let (status, body) = exchange(served.address, &huge).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (431, Some("header_fields_too_large"))
    );
    served.stop().await;
}
