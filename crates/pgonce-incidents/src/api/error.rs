//! The HTTP error: a status and a JSON body `{"error": {"code", "message"}}`
//! with a stable code. Database detail never reaches the client: an
//! internal error, and a 503 `busy` or `unavailable`, is logged here and
//! answered with a fixed message. (A 503 `pooler` names the pooler's
//! misconfiguration and its fix, which an operator needs to see.)

use axum::Json;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::error::Error;

/// How the message of a 400 `malformed_json` begins (serde_json's error
/// follows).
pub(crate) const MALFORMED_PREFIX: &str = "the body is not valid JSON: ";

/// How serde_json's `NumberOutOfRange` error begins.
const NUMBER_OUT_OF_RANGE: &str = "number out of range";

/// How serde_json's `RecursionLimitExceeded` error begins.
const RECURSION_LIMIT_EXCEEDED: &str = "recursion limit exceeded";

/// How deep a request body's arrays and objects may nest, the body's own
/// object included: serde_json stops at the 128th level.
const MAX_BODY_NESTING: usize = 127;

/// An error answer of the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status of the answer.
    pub status: StatusCode,
    /// Stable, machine-readable: `not_found`, `invalid`, `malformed_json`,
    /// `unauthorized`, `invalid_transition`, `conflict`, `already_exists`,
    /// `payload_too_large`, `busy`, `unavailable`, `pooler` (the connection
    /// pooler in front of PostgreSQL is set up wrongly; the message names
    /// the cause and the fix), `no_route`,
    /// `method_not_allowed`, `internal`.
    pub code: &'static str,
    /// What went wrong, for a person; never database detail.
    pub message: String,
}

impl ApiError {
    /// An answer with `status`, `code` (one of [`ApiError::code`]'s) and
    /// `message`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    pub(crate) fn unauthorized(message: &'static str) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub(crate) fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid", message)
    }

    pub(crate) fn too_large() -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            "the request body is larger than the limit",
        )
    }

    /// A JSON body that could not be read: not JSON at all (400), or JSON
    /// of the wrong shape: wrong types, missing or unknown fields (422).
    ///
    /// A number past a double's range (`1e400`) is valid JSON, but
    /// serde_json stops at it with a syntax error, `NumberOutOfRange`: it
    /// is answered like every other number the API cannot keep (`1e-400`,
    /// refused once parsed), 422. So is JSON nested deeper than serde_json
    /// reads ([`MAX_BODY_NESTING`]), where serde_json stops with another
    /// syntax error, `RecursionLimitExceeded`: its message says how deep
    /// a body may nest. serde_json does not expose the error's code, only
    /// its text, so each code is recognised by the text it prints (a unit
    /// test holds them together).
    pub(crate) fn from_json(e: serde_json::Error) -> ApiError {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => ApiError::invalid(e.to_string()),
            Category::Syntax if e.to_string().starts_with(NUMBER_OUT_OF_RANGE) => {
                ApiError::invalid(format!(
                    "the number at line {} column {} is past a double's range: it cannot be kept",
                    e.line(),
                    e.column()
                ))
            }
            Category::Syntax if e.to_string().starts_with(RECURSION_LIMIT_EXCEEDED) => {
                ApiError::invalid(format!(
                    "the array or object at line {} column {} is nested too deep: arrays and \
                     objects nest at most {MAX_BODY_NESTING} deep in a body, its own object included",
                    e.line(),
                    e.column()
                ))
            }
            Category::Syntax | Category::Eof | Category::Io => ApiError::new(
                StatusCode::BAD_REQUEST,
                "malformed_json",
                format!("{MALFORMED_PREFIX}{e}"),
            ),
        }
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        let code = e.code();
        let status = match code {
            "not_found" => StatusCode::NOT_FOUND,
            "invalid_transition" | "already_exists" | "conflict" => StatusCode::CONFLICT,
            "invalid" => StatusCode::UNPROCESSABLE_ENTITY,
            "payload_too_large" => StatusCode::PAYLOAD_TOO_LARGE,
            "unauthorized" => StatusCode::UNAUTHORIZED,
            "busy" | "unavailable" | "pooler" | "evaluation_failed" => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!(error = %e, "API request failed");
            return ApiError::new(status, "internal", "internal error");
        }
        if code == "pooler" {
            tracing::error!(error = %e, "API request failed: the connection pooler is misconfigured");
        }
        // Their text is PostgreSQL's, sqlx's or the queue client's (a
        // server's message, an address, a lock key): logged, and answered
        // with a fixed message that says only what to do.
        if code == "busy" || code == "unavailable" {
            if let Error::Pgonce(pgonce::Error::QueueNotFound { name }) = &e {
                // Not for the client to fix, nor passing by itself: the
                // operator's, told here what to do.
                tracing::error!(
                    queue = %name,
                    "API request failed: the queue {name:?} does not exist (deleted by hand?); \
                     nothing is sent to it until it exists again: restart `pgonce serve` or \
                     `pgonce worker`, which create it (on Amazon SQS with \
                     `queue.sqs.create = true`), or create it again by hand"
                );
            } else {
                tracing::warn!(error = %e, code, "API request failed; the client may retry");
            }
            let message = match (code, &e) {
                ("busy", _) => "what this request needs is busy with another one; retry it",
                (
                    _,
                    Error::Pgonce(
                        pgonce::Error::Unavailable { .. }
                        | pgonce::Error::Backend { .. }
                        | pgonce::Error::QueueNotFound { .. },
                    ),
                ) => "the queue cannot serve this request now; retry later",
                _ => "the database cannot serve this request now; retry later",
            };
            return ApiError::new(status, code, message);
        }
        if status == StatusCode::CONFLICT {
            tracing::warn!(error = %e, "API request refused");
        }
        ApiError::new(status, code, e.to_string())
    }
}

impl From<BytesRejection> for ApiError {
    fn from(r: BytesRejection) -> ApiError {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large()
        } else {
            ApiError::new(r.status(), "bad_request", r.body_text())
        }
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> ApiError {
        ApiError::invalid(format!("path: {}", r.body_text()))
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> ApiError {
        ApiError::invalid(format!("query: {}", r.body_text()))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(json!({ "error": { "code": self.code, "message": self.message } })),
        )
            .into_response();
        let headers = response.headers_mut();
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A number past a double's range is 422, like any number the API
    /// cannot keep; a body that is not JSON is still 400, a broken number
    /// (`1e`) included.
    #[test]
    fn a_number_past_a_doubles_range_is_invalid_not_malformed() {
        let answer = |body: &str| {
            let e = serde_json::from_str::<serde_json::Value>(body).unwrap_err();
            let a = ApiError::from_json(e);
            (a.status, a.code)
        };
        for body in [
            r#"{"x": 1e400}"#,
            r#"{"x": [-1e400]}"#,
            &format!("{{\"x\": 1{}}}", "0".repeat(400)),
        ] {
            assert_eq!(
                answer(body),
                (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
                "{body}"
            );
        }
        for body in [r#"{"x": 1e}"#, r#"{"x": 1"#, r#"{"x" 1}"#, "nope"] {
            assert_eq!(
                answer(body),
                (StatusCode::BAD_REQUEST, "malformed_json"),
                "{body}"
            );
        }
    }

    /// JSON nested deeper than serde_json reads is 422 with a message that
    /// says how deep a body may nest; [`MAX_BODY_NESTING`] levels are read.
    #[test]
    fn json_nested_too_deep_is_invalid_not_malformed() {
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        serde_json::from_str::<serde_json::Value>(&nested(MAX_BODY_NESTING)).unwrap();
        for body in [nested(MAX_BODY_NESTING + 1), "[".repeat(1000)] {
            let e = serde_json::from_str::<serde_json::Value>(&body).unwrap_err();
            let a = ApiError::from_json(e);
            assert_eq!(
                (a.status, a.code),
                (StatusCode::UNPROCESSABLE_ENTITY, "invalid")
            );
            assert!(a.message.contains("nested too deep"), "{}", a.message);
        }
    }

    /// A 503's message is the API's own: nothing of PostgreSQL's, sqlx's
    /// or a queue client's text reaches the client (it is logged instead).
    #[test]
    fn service_unavailable_answers_carry_no_database_detail() {
        let conflict = "could not serialize access due to concurrent update";
        let refused = std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connect to 10.1.2.3:5432 refused",
        );
        let cases: Vec<(Error, &str, &str)> = vec![
            (
                pgonce::Error::SerializationFailure {
                    sqlstate: "40001".into(),
                    message: conflict.into(),
                }
                .into(),
                "busy",
                conflict,
            ),
            (
                pgonce::Error::LockTimeout {
                    key: pgonce::LockKey::from_raw(-4242),
                    waited: std::time::Duration::from_secs(10),
                }
                .into(),
                "busy",
                "4242",
            ),
            (
                pgonce::Error::LockNotAvailable {
                    message: "canceling statement due to lock timeout".into(),
                }
                .into(),
                "busy",
                "lock timeout",
            ),
            (
                pgonce::Error::QueryCanceled {
                    message: "canceling statement due to statement timeout".into(),
                }
                .into(),
                "busy",
                "statement timeout",
            ),
            (
                pgonce::Error::QueueChangedDuringSend {
                    queue: "observations".into(),
                    attempts: 3,
                }
                .into(),
                "busy",
                "observations",
            ),
            (
                pgonce::Error::Unavailable {
                    backend: "sqs",
                    reason: "dns error: no host sqs.internal".into(),
                }
                .into(),
                "unavailable",
                "sqs.internal",
            ),
            (
                pgonce::Error::Backend {
                    backend: "sqs",
                    code: "RequestThrottled".into(),
                    message: "Rate exceeded for queue observations.fifo".into(),
                }
                .into(),
                "unavailable",
                "observations.fifo",
            ),
            (
                pgonce::Error::QueueNotFound {
                    name: "incidents-observations".into(),
                }
                .into(),
                "unavailable",
                "incidents-observations",
            ),
            (sqlx::Error::Io(refused).into(), "unavailable", "10.1.2.3"),
            (sqlx::Error::PoolTimedOut.into(), "unavailable", "timed out"),
            (sqlx::Error::PoolClosed.into(), "unavailable", "closed"),
        ];
        for (e, code, detail) in cases {
            let a = ApiError::from(e);
            assert_eq!((a.status, a.code), (StatusCode::SERVICE_UNAVAILABLE, code));
            assert!(
                !a.message.contains(detail) && !a.message.contains("database error"),
                "{code}: {}",
                a.message
            );
        }
    }
}
