//! The SDK's retries: what it may retry of a send ([`NoBlindResend`]),
//! and when the attempt that answered went out ([`AttemptClock`]).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use aws_sdk_sqs::config::interceptors::{BeforeTransmitInterceptorContextRef, InterceptorContext};
use aws_sdk_sqs::config::retry::{ClassifyRetry, RetryAction};
use aws_sdk_sqs::config::{ConfigBag, Intercept, RuntimeComponents};

/// Forbids the SDK's retry of a send to a standard queue after an attempt
/// SQS may have taken: its answer lost (a connection dropped, reset or
/// closed mid-exchange), unreadable, or a server error (5xx). SQS may have
/// enqueued the messages then, and a standard queue takes a second copy as
/// a second message; the call fails instead, [`pgonce::Error::Unavailable`]
/// (or [`pgonce::Error::Backend`] for a 5xx), and the caller decides.
///
/// It leaves the SDK's other classifiers to retry what SQS did not take:
/// a refusal SQS answered with a client error (4xx: throttled), and an
/// attempt whose connection was never made (refused, no route, DNS).
/// FIFO sends do not need it: each message goes with a deduplication id,
/// the same on a retry, and SQS drops the second copy.
#[derive(Debug)]
pub(crate) struct NoBlindResend;

impl ClassifyRetry for NoBlindResend {
    fn classify_retry(&self, ctx: &InterceptorContext) -> RetryAction {
        let Some(Err(error)) = ctx.output_or_error() else {
            return RetryAction::NoActionIndicated;
        };
        let refused = error.is_operation_error()
            && ctx
                .response()
                .is_some_and(|answer| answer.status().is_client_error());
        let never_connected = error
            .as_connector_error()
            .is_some_and(|e| connection_never_made(e));
        if refused || never_connected {
            RetryAction::NoActionIndicated
        } else {
            RetryAction::RetryForbidden
        }
    }

    fn name(&self) -> &'static str {
        "pgonce-sqs: no blind resend to a standard queue"
    }
}

/// Whether `error` says its request's connection was never made: the SDK's
/// HTTP client (hyper-util's) reports a failure to connect as such
/// (`is_connect`), somewhere in the chain of sources.
fn connection_never_made(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.downcast_ref::<hyper_util::client::legacy::Error>()
            .is_some_and(hyper_util::client::legacy::Error::is_connect)
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// Notes when each attempt of one request goes out to SQS, after the
/// SDK's retries of the attempts before it (their backoff included) and
/// just before its HTTP client sends it: the last time noted is when the
/// attempt that answered went out, which SQS cannot have acted on before.
/// One per request (a clone shares the time).
#[derive(Debug, Clone, Default)]
pub(crate) struct AttemptClock(Arc<Mutex<Option<Instant>>>);

impl AttemptClock {
    /// When the last attempt went out; `None` before the first.
    pub(crate) fn last_sent(&self) -> Option<Instant> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Intercept for AttemptClock {
    fn name(&self) -> &'static str {
        "pgonce-sqs: when the last attempt went out"
    }

    fn read_before_transmit(
        &self,
        _context: &BeforeTransmitInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        _config: &mut ConfigBag,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        Ok(())
    }
}

/// The SDK configuration a send to a queue overrides: [`NoBlindResend`]
/// on a standard queue (`fifo` false); nothing on a FIFO queue.
pub(crate) fn for_sends(fifo: bool) -> Option<aws_sdk_sqs::config::Builder> {
    (!fifo).then(|| aws_sdk_sqs::config::Builder::default().retry_classifier(NoBlindResend))
}

#[cfg(test)]
mod tests {
    use aws_sdk_sqs::error::ConnectorError;
    use http_body_util::Empty;
    use hyper::body::Bytes;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    use super::*;

    /// A connection refused, as the SDK's HTTP client reports it wrapped
    /// in the SDK's connector error, is one never made (the SDK may retry
    /// the send); a connection reset after the request went out is not.
    #[tokio::test]
    async fn a_refused_connection_is_never_made_and_a_reset_one_was() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = closed.local_addr().unwrap();
        drop(closed);
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let refused = client
            .get(format!("http://{address}/").parse().unwrap())
            .await
            .unwrap_err();
        let refused = ConnectorError::io(Box::new(refused));
        assert!(connection_never_made(&refused), "{refused:?}");
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let reset = ConnectorError::io(Box::new(reset));
        assert!(!connection_never_made(&reset), "{reset:?}");
    }
}
