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

/// [`map`] for a call on the queue at `url`: a queue SQS does not know is
/// [`Error::QueueNotFound`] naming that queue, the last segment of its URL
/// (SQS's answer does not name it: its message only says that the queue
/// does not exist).
pub(crate) fn map_on<E, R>(e: SdkError<E, R>, url: &str, receipt: Option<&str>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    match map(e, receipt) {
        Error::QueueNotFound { .. } => Error::QueueNotFound {
            name: url.rsplit('/').next().unwrap_or(url).to_string(),
        },
        other => other,
    }
}

/// A refused receipt (`receipt` as the caller gave it), counted and
/// logged with `why`: the code SQS refused it with, or why pgonce refused
/// it without asking SQS.
pub(crate) fn stale(receipt: &str, why: &str) -> Error {
    metrics::counter!("pgonce_sqs_stale_receipts_total").increment(1);
    tracing::warn!(receipt, why, "stale receipt refused");
    Error::StaleReceipt {
        receipt: receipt.to_string(),
    }
}

/// The prefix SQS puts on most of its error codes. The SDK reports the code
/// SQS's query protocol gave an error (the `x-amzn-query-error` header), so
/// a message not in flight is `AWS.SimpleQueueService.MessageNotInflight`
/// from SQS and `MessageNotInflight` from a server that sends no such header;
/// codes are matched without it.
const CODE_PREFIX: &str = "AWS.SimpleQueueService.";

/// A service error code (also of one batch entry) to a variant.
pub(crate) fn from_code(code: &str, message: &str, receipt: Option<&str>) -> Error {
    match (code.strip_prefix(CODE_PREFIX).unwrap_or(code), receipt) {
        // A receipt the server does not take, or whose message is no longer
        // in flight under it.
        ("ReceiptHandleIsInvalid" | "MessageNotInflight" | "InvalidReceiptHandle", Some(r)) => {
            stale(r, code)
        }
        ("QueueDoesNotExist" | "NonExistentQueue", _) => Error::QueueNotFound {
            name: message.to_string(),
        },
        // A purge within 60 s of the queue's last one (the caller names
        // the queue: SQS only words it in the message).
        ("PurgeQueueInProgress", _) => Error::PurgeInProgress {
            queue: message.to_string(),
        },
        _ => Error::Backend {
            backend: BACKEND,
            code: code.to_string(),
            message: message.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The codes SQS sends for a receipt it refuses, as the SDK reports
    /// them (the query-protocol code, prefixed or not), are a stale receipt
    /// when a receipt was given; a worker stops its heartbeats on it.
    /// (`AWS.SimpleQueueService.MessageNotInflight`, SQS's answer to a
    /// visibility change of a message visible again, was a `Backend`
    /// error: the heartbeat went on beating.)
    #[test]
    fn refused_receipts_are_stale_with_or_without_the_prefix() {
        for code in [
            "AWS.SimpleQueueService.MessageNotInflight",
            "MessageNotInflight",
            "ReceiptHandleIsInvalid",
            "AWS.SimpleQueueService.ReceiptHandleIsInvalid",
        ] {
            let e = from_code(code, "", Some("r"));
            assert!(
                matches!(&e, Error::StaleReceipt { receipt } if receipt == "r"),
                "{code}: {e:?}"
            );
        }
        for code in [
            "AWS.SimpleQueueService.NonExistentQueue",
            "QueueDoesNotExist",
        ] {
            let e = from_code(code, "q", None);
            assert!(matches!(&e, Error::QueueNotFound { .. }), "{code}: {e:?}");
        }
        let e = from_code("AWS.SimpleQueueService.OverLimit", "m", None);
        assert!(
            matches!(&e, Error::Backend { code, .. } if code == "AWS.SimpleQueueService.OverLimit"),
            "{e:?}"
        );
    }

    /// A purge within 60 s of the last one, refused by SQS with
    /// `AWS.SimpleQueueService.PurgeQueueInProgress` (a server without the
    /// query-protocol header sends it bare), is `PurgeInProgress`: the
    /// caller can tell that its purge deleted nothing and purge again
    /// later. (It was a `Backend` error, to be matched by its code.)
    #[test]
    fn a_purge_under_way_is_purge_in_progress_with_or_without_the_prefix() {
        let message = "Only one PurgeQueue operation on q is allowed every 60 seconds.";
        for code in [
            "AWS.SimpleQueueService.PurgeQueueInProgress",
            "PurgeQueueInProgress",
        ] {
            let e = from_code(code, message, None);
            assert!(matches!(&e, Error::PurgeInProgress { .. }), "{code}: {e:?}");
        }
    }
}
