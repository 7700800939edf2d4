//! Test support: a throwaway moto server (pgonce-testkit's [`Moto`]), a
//! client on it, and a [`Front`] to it that fails requests on order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use pgonce_sqs::{SqsClient, SqsConfig};
pub use pgonce_testkit::Moto;

/// Starts moto; panics with the reason (not installed, did not come up).
pub fn start() -> Moto {
    Moto::start().unwrap_or_else(|e| panic!("{e}"))
}

/// A client of `moto`.
pub async fn client(moto: &Moto) -> SqsClient {
    SqsClient::connect(SqsConfig::local(moto.endpoint()))
        .await
        .expect("SDK config")
}

/// What a [`Front`] does to a request it was told to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Passes the request on to moto, which acts on it, then closes the
    /// connection without answering: a request SQS took whose answer
    /// was lost (a connection dropped mid-exchange).
    AnswerLost,
    /// Passes the request on to moto, which acts on it, and never answers:
    /// a request SQS took, whose answer does not come before the client's
    /// timeout.
    AnswerWithheld,
    /// Answers 503 `ServiceUnavailable` without passing the request on,
    /// as SQS answers one it could not serve: nothing done here, but to
    /// the client a server error says not whether SQS acted.
    Refused,
    /// Answers 400 `ThrottlingException` without passing the request on,
    /// as SQS refuses a request over its rate: nothing done.
    Throttled,
}

/// An HTTP front to a moto server, on a loopback port of its own: every
/// request goes on to moto and its answer comes back, but for those it
/// was told to fail ([`Front::fail`]). moto has no way to lose an answer
/// after acting on a request, which the SDK's retries are about; this
/// does it. Stops serving when dropped.
pub struct Front {
    endpoint: String,
    shared: Arc<FrontState>,
    server: tokio::task::JoinHandle<()>,
}

/// What a front's connections share.
struct FrontState {
    moto: String,
    client: reqwest::Client,
    faults: Mutex<Faults>,
}

/// The faults a front is to apply, and what it saw.
#[derive(Default)]
struct Faults {
    /// Per operation (`SendMessageBatch`): the fault for its next requests,
    /// and how many more it applies to.
    armed: HashMap<String, (Fault, u32)>,
    /// Per operation: the requests seen.
    seen: HashMap<String, u32>,
    /// When the last fault was applied, the request read whole (and, for
    /// [`Fault::AnswerLost`], moto's answer in hand).
    faulted_at: Option<Instant>,
}

/// Why a front closed a connection without answering.
#[derive(Debug, thiserror::Error)]
enum FrontError {
    #[error("the answer is lost on purpose")]
    AnswerLost,
    #[error("reading the request: {0}")]
    Read(#[from] hyper::Error),
    #[error("passing the request on to moto: {0}")]
    Moto(#[from] reqwest::Error),
}

impl Front {
    /// A front to `moto`, serving at once.
    pub async fn start(moto: &Moto) -> Front {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let shared = Arc::new(FrontState {
            moto: moto.endpoint().to_string(),
            // Straight to moto, whatever proxy the environment names.
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
            faults: Mutex::default(),
        });
        let serving = shared.clone();
        let server = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let shared = serving.clone();
                let service = hyper::service::service_fn(move |request| {
                    let shared = shared.clone();
                    async move { shared.handle(request).await }
                });
                // A service error closes the connection without an answer.
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
                );
            }
        });
        Front {
            endpoint,
            shared,
            server,
        }
    }

    /// Its base URL, for [`SqsConfig::local`].
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Applies `fault` to the next `times` requests of SQS's `operation`
    /// (`SendMessageBatch`, `ReceiveMessage`).
    pub fn fail(&self, operation: &str, fault: Fault, times: u32) {
        let mut faults = self.shared.faults.lock().unwrap();
        faults.armed.insert(operation.to_string(), (fault, times));
    }

    /// The requests of `operation` seen so far, failed ones included.
    pub fn requests(&self, operation: &str) -> u32 {
        let faults = self.shared.faults.lock().unwrap();
        faults.seen.get(operation).copied().unwrap_or(0)
    }

    /// When the last fault was applied: after its request was read whole.
    pub fn faulted_at(&self) -> Option<Instant> {
        self.shared.faults.lock().unwrap().faulted_at
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl FrontState {
    /// The fault to apply to a request of `operation`, if any; counts it.
    fn take(&self, operation: &str) -> Option<Fault> {
        let mut faults = self.faults.lock().unwrap();
        *faults.seen.entry(operation.to_string()).or_default() += 1;
        let (fault, left) = faults.armed.get_mut(operation)?;
        let fault = *fault;
        *left -= 1;
        if *left == 0 {
            faults.armed.remove(operation);
        }
        Some(fault)
    }

    fn faulted_now(&self) {
        self.faults.lock().unwrap().faulted_at = Some(Instant::now());
    }

    async fn handle(
        &self,
        request: Request<Incoming>,
    ) -> Result<Response<Full<Bytes>>, FrontError> {
        // SQS's JSON protocol names the operation in this header.
        let operation = request
            .headers()
            .get("x-amz-target")
            .and_then(|v| v.to_str().ok())
            .and_then(|t| t.strip_prefix("AmazonSQS."))
            .unwrap_or_default()
            .to_string();
        let (parts, body) = request.into_parts();
        let body = body.collect().await?.to_bytes();
        let fault = self.take(&operation);
        let refusal = match fault {
            Some(Fault::Refused) => Some((StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailable")),
            Some(Fault::Throttled) => Some((StatusCode::BAD_REQUEST, "ThrottlingException")),
            Some(Fault::AnswerLost | Fault::AnswerWithheld) | None => None,
        };
        if let Some((status, code)) = refusal {
            self.faulted_now();
            let body = format!(r#"{{"__type":"{code}","message":"refused on purpose"}}"#);
            return Ok(Response::builder()
                .status(status)
                .header(hyper::header::CONTENT_TYPE, "application/x-amz-json-1.0")
                .body(Full::new(Bytes::from(body)))
                .expect("a valid answer"));
        }
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let mut headers = parts.headers;
        headers.remove(hyper::header::HOST);
        let answer = self
            .client
            .request(parts.method, format!("{}{path}", self.moto))
            .headers(headers)
            .body(body)
            .send()
            .await?;
        let status = answer.status();
        let content_type = answer.headers().get(hyper::header::CONTENT_TYPE).cloned();
        let body = answer.bytes().await?;
        match fault {
            Some(Fault::AnswerLost) => {
                self.faulted_now();
                return Err(FrontError::AnswerLost);
            }
            Some(Fault::AnswerWithheld) => {
                self.faulted_now();
                // Until the client gives up and closes the connection.
                std::future::pending::<()>().await;
            }
            _ => {}
        }
        let mut response = Response::builder().status(status);
        if let Some(content_type) = content_type {
            response = response.header(hyper::header::CONTENT_TYPE, content_type);
        }
        Ok(response.body(Full::new(body)).expect("a valid answer"))
    }
}
