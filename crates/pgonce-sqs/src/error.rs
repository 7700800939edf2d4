//! SDK errors to [`pgonce::Error`], in one place.

use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use pgonce::Error;

pub(crate) const BACKEND: &str = "sqs";

/// What the receipt of a call was, so a refused one becomes `StaleReceipt`.
pub(crate) fn map<E, R>(e: SdkError<E, R>, receipt: Option<&str>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    match &e {
        SdkError::ServiceError(service) => {
            let err = service.err();
            from_code(
                err.code().unwrap_or("Unknown"),
                err.message().unwrap_or_default(),
                receipt,
            )
        }
        SdkError::ConstructionFailure(_) => Error::Invalid {
            what: "SQS request",
            why: DisplayErrorContext(&e).to_string(),
        },
        // Timeouts, refused connections, DNS and TLS failures, and replies
        // that are not SQS's.
        _ => {
            metrics::counter!("pgonce_sqs_unavailable_total").increment(1);
            tracing::warn!(error = %DisplayErrorContext(&e), "SQS unavailable");
            Error::Unavailable {
                backend: BACKEND,
                reason: DisplayErrorContext(&e).to_string(),
            }
        }
    }
}

/// A service error code (also of one batch entry) to a variant.
pub(crate) fn from_code(code: &str, message: &str, receipt: Option<&str>) -> Error {
    match (code, receipt) {
        // A receipt the server does not take, or whose message is no longer
        // in flight under it.
        ("ReceiptHandleIsInvalid" | "MessageNotInflight" | "InvalidReceiptHandle", Some(r)) => {
            metrics::counter!("pgonce_sqs_stale_receipts_total").increment(1);
            tracing::warn!(receipt = r, code, "stale receipt refused by SQS");
            Error::StaleReceipt {
                receipt: r.to_string(),
            }
        }
        ("QueueDoesNotExist" | "AWS.SimpleQueueService.NonExistentQueue", _) => {
            Error::QueueNotFound {
                name: message.to_string(),
            }
        }
        _ => Error::Backend {
            backend: BACKEND,
            code: code.to_string(),
            message: message.to_string(),
        },
    }
}
