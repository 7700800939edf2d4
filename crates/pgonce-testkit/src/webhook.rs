//! A local webhook receiver, for the demo and the tests of the incident
//! service's notifier: it deduplicates deliveries by their
//! [`IDEMPOTENCY_HEADER`] (as a real receiver should) and can misbehave on
//! purpose: answer 500, or accept the notification but answer too late, so
//! the sender times out and retries with the same key. It lives in the test
//! kit, not in the service, so that a deployed server links none of it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use rand::Rng;
use tokio::sync::oneshot;

/// The header a notification carries its idempotency key in: the incident
/// service's `notifier::IDEMPOTENCY_HEADER`, which its tests check this
/// against (the service does not depend on the test kit, so the name is
/// written twice).
pub const IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// Why a receiver could not start.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// A fault rate outside [0, 1].
    #[error("receiver fault rate {0} is outside [0, 1]")]
    FaultRate(f64),
    /// The loopback listener could not be bound.
    #[error("webhook receiver: {0}")]
    Listen(#[from] std::io::Error),
}

/// How the receiver misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ReceiverFaults {
    /// Share of requests answered 500 without being accepted.
    pub fail_rate: f64,
    /// Share of requests accepted, then answered after `late_by`.
    pub late_rate: f64,
    /// How late a late answer is (make it exceed the sender's timeout).
    pub late_by: Duration,
}

/// What the receiver saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReceiverStats {
    /// Requests received, all outcomes.
    pub requests: u64,
    /// Distinct idempotency keys accepted: notifications delivered.
    pub accepted: u64,
    /// Requests carrying a key already accepted: dropped as duplicates.
    pub duplicates: u64,
    /// Requests refused on purpose (500).
    pub refused: u64,
    /// Requests accepted but answered late on purpose.
    pub late: u64,
    /// Requests without a key.
    pub without_key: u64,
}

/// A notification the receiver accepted: the first request carrying its
/// key that was not refused. Repeats of the key are not logged again.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AcceptedDelivery {
    /// Its [`IDEMPOTENCY_HEADER`].
    pub key: String,
    /// Its body as sent (lossily decoded as UTF-8), for the caller to read
    /// what the notification was about.
    pub body: String,
}

#[derive(Default)]
struct Seen {
    stats: ReceiverStats,
    keys: HashMap<String, u32>,
    accepted: Vec<AcceptedDelivery>,
}

#[derive(Clone)]
struct Shared {
    faults: ReceiverFaults,
    seen: Arc<Mutex<Seen>>,
}

/// A running receiver; stops when dropped.
pub struct WebhookReceiver {
    url: String,
    shared: Shared,
    _stop: oneshot::Sender<()>,
}

impl WebhookReceiver {
    /// Listens on 127.0.0.1 at a free port.
    pub async fn start(faults: ReceiverFaults) -> Result<WebhookReceiver, WebhookError> {
        for rate in [faults.fail_rate, faults.late_rate] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(WebhookError::FaultRate(rate));
            }
        }
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        let shared = Shared {
            faults,
            seen: Arc::default(),
        };
        let app = Router::new()
            .route("/hook", post(receive))
            .with_state(shared.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(WebhookReceiver {
            url: format!("http://{addr}/hook"),
            shared,
            _stop: stop,
        })
    }

    /// The URL to post notifications to (`http://127.0.0.1:<port>/hook`),
    /// for the incident service's `NotifierConfig::new`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The counts so far.
    pub fn stats(&self) -> ReceiverStats {
        self.shared.seen.lock().expect("not poisoned").stats
    }

    /// How many times each accepted key arrived (1 = no duplicate).
    pub fn deliveries(&self) -> HashMap<String, u32> {
        self.shared.seen.lock().expect("not poisoned").keys.clone()
    }

    /// The receiver's log: every notification accepted, once per key, in
    /// the order accepted.
    pub fn accepted(&self) -> Vec<AcceptedDelivery> {
        self.shared
            .seen
            .lock()
            .expect("not poisoned")
            .accepted
            .clone()
    }
}

async fn receive(State(shared): State<Shared>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let (refuse, late) = {
        let mut rng = rand::rng();
        (
            rng.random::<f64>() < shared.faults.fail_rate,
            rng.random::<f64>() < shared.faults.late_rate,
        )
    };
    let key = headers
        .get(IDEMPOTENCY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    {
        let mut seen = shared.seen.lock().expect("not poisoned");
        seen.stats.requests += 1;
        let Some(key) = key else {
            seen.stats.without_key += 1;
            return StatusCode::BAD_REQUEST;
        };
        if refuse {
            seen.stats.refused += 1;
            return StatusCode::INTERNAL_SERVER_ERROR;
        }
        let n = seen.keys.entry(key.clone()).or_default();
        *n += 1;
        if *n == 1 {
            seen.stats.accepted += 1;
            seen.accepted.push(AcceptedDelivery {
                key,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        } else {
            seen.stats.duplicates += 1;
        }
        if late {
            seen.stats.late += 1;
        }
    }
    if late {
        tokio::time::sleep(shared.faults.late_by).await;
    }
    StatusCode::OK
}
