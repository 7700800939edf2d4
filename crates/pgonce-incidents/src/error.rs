//! The service's errors: each is a case a caller (the HTTP API, the CLI,
//! a test) handles differently, so each is a variant to match.

/// What went wrong in the incident service.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No such row in the caller's organization (a row of another
    /// organization is reported the same way: its existence is not revealed).
    #[error("{what} {id} not found")]
    NotFound {
        /// What was looked for (`incident`, `entity`, `policy`).
        what: &'static str,
        /// The id asked for, as given.
        id: String,
    },

    /// The incident is not in a state from which this transition is allowed
    /// (acknowledging a resolved incident, resolving one twice).
    #[error("incident {id} is {from}; cannot {action} it")]
    InvalidTransition {
        /// The incident's id.
        id: i64,
        /// Its lifecycle state when the transition was refused (`RESOLVED`).
        from: String,
        /// The refused transition (`acknowledge`, `resolve`).
        action: &'static str,
    },

    /// Input that can never succeed (an empty name, a malformed rule, a body
    /// that is not an observation).
    #[error("invalid {what}: {why}")]
    Invalid {
        /// What was rejected (`title`, `rule value`, `observation`).
        what: &'static str,
        /// Why, in words a caller can show.
        why: String,
    },

    /// A policy's evaluation failed (its evaluator returned an error: a
    /// remote call refused or timed out). Transient: the pipeline leaves the
    /// message on the queue, and its redelivery evaluates again.
    #[error("evaluating policy {policy:?} failed: {why}")]
    Evaluation {
        /// The policy's name.
        policy: String,
        /// The evaluator's error.
        why: String,
    },

    /// A name or key that must be unique already exists.
    #[error("{what} already exists")]
    AlreadyExists {
        /// What already exists (`organization`, `policy`).
        what: &'static str,
    },

    /// A missing, malformed or revoked API key.
    #[error("unauthorized: {0}")]
    Unauthorized(&'static str),

    /// A pgonce safeguard refused or failed: a guarded write's conflict, a
    /// lock timeout, a database error.
    #[error(transparent)]
    Pgonce(#[from] pgonce::Error),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Pgonce(e.into())
    }
}

impl Error {
    /// A stable, machine-readable code (the HTTP API's `error.code`).
    pub fn code(&self) -> &'static str {
        match self {
            Error::NotFound { .. } => "not_found",
            Error::InvalidTransition { .. } => "invalid_transition",
            Error::Invalid { .. } => "invalid",
            Error::Evaluation { .. } => "evaluation_failed",
            Error::AlreadyExists { .. } => "already_exists",
            Error::Unauthorized(_) => "unauthorized",
            Error::Pgonce(pgonce::Error::Conflict { .. }) => "conflict",
            Error::Pgonce(pgonce::Error::Invalid { .. }) => "invalid",
            // An observation over the queue's message limit (a body limit
            // configured above it lets one through the HTTP layer).
            Error::Pgonce(pgonce::Error::MessageTooLarge { .. }) => "payload_too_large",
            Error::Pgonce(pgonce::Error::LockTimeout { .. }) => "busy",
            Error::Pgonce(pgonce::Error::SerializationFailure { .. }) => "busy",
            // The operator's bounds on the database's waits: a row lock
            // past `lock_timeout`, a statement past `statement_timeout` (or
            // canceled). Contention or load on the data, as above; the
            // request changed nothing and may be sent again.
            Error::Pgonce(pgonce::Error::LockNotAvailable { .. }) => "busy",
            Error::Pgonce(pgonce::Error::QueryCanceled { .. }) => "busy",
            // The organization's number was taken by another process
            // meanwhile (one numbering under another strategy, during a
            // deploy that changes `numbering`): nothing was written, and
            // the retry takes the next number.
            Error::Pgonce(pgonce::Error::NumberTaken { .. }) => "busy",
            // The queue's settings changed under each attempt to send.
            Error::Pgonce(pgonce::Error::QueueChangedDuringSend { .. }) => "busy",
            Error::Pgonce(pgonce::Error::Unavailable { .. }) => "unavailable",
            // The queue backend answered with an error of its own: throttled
            // (`RequestThrottled`), a server error, a KMS key it cannot use.
            // Never the observation's: what a backend refuses in a message
            // (its size, its characters, its ids) is checked before the send
            // (`Invalid`, `MessageTooLarge`). The backend's to get past or an
            // operator's to fix; the request may be sent again.
            Error::Pgonce(pgonce::Error::Backend { .. }) => "unavailable",
            // The queue is gone (deleted by hand): nothing can be taken
            // until an operator creates it again, which the API's log says
            // how to do. Not the request's fault, and the same request
            // succeeds once the queue exists again.
            Error::Pgonce(pgonce::Error::QueueNotFound { .. }) => "unavailable",
            // The pooler in front of PostgreSQL is set up wrongly: an
            // operator's to fix, named in the message; not this request's.
            Error::Pgonce(pgonce::Error::Pooler { .. }) => "pooler",
            // No connection within the pool's acquire timeout: the database
            // is down or refusing connections (the pool retries a refused
            // connect until then), or every connection is taken. Either way
            // this process cannot reach the database now; `busy` is kept
            // for contention on the data itself (locks, serialization).
            Error::Pgonce(pgonce::Error::Database(sqlx::Error::PoolTimedOut)) => "unavailable",
            // The database cannot be reached (refused, reset, shut down).
            Error::Pgonce(pgonce::Error::Database(
                sqlx::Error::Io(_) | sqlx::Error::PoolClosed,
            )) => "unavailable",
            // PostgreSQL refused or ended the session: connection
            // exceptions (class 08), shutdown or start-up (57P01-57P03),
            // any FATAL (a session timeout, a terminated backend). The
            // request's transaction rolled back with it.
            Error::Pgonce(pgonce::Error::Database(e)) if pgonce::error::session_ended(e) => {
                "unavailable"
            }
            // PostgreSQL refused the statement for now, not for what it
            // asked: ended no session, wrote nothing, and the same request
            // succeeds once the server takes writes again.
            Error::Pgonce(pgonce::Error::Database(e)) if refused_for_now(e) => "unavailable",
            Error::Pgonce(_) => "internal",
        }
    }

    pub(crate) fn invalid(what: &'static str, why: impl Into<String>) -> Error {
        Error::Invalid {
            what,
            why: why.into(),
        }
    }

    pub(crate) fn not_found(what: &'static str, id: impl ToString) -> Error {
        Error::NotFound {
            what,
            id: id.to_string(),
        }
    }
}

/// Whether PostgreSQL refused a statement for a state of the server that
/// passes: a read-only transaction on a server that takes no writes now
/// (`read_only_sql_transaction`, 25006: a standby, or a server or role put
/// read-only for maintenance), or a resource it is short of (class 53,
/// `insufficient_resources`: disk full, out of memory, too many
/// connections, a configured limit such as `max_locks_per_transaction`).
/// PostgreSQL reports them as a plain ERROR, which ends no session, so
/// [`pgonce::error::session_ended`] does not cover them.
fn refused_for_now(e: &sqlx::Error) -> bool {
    pgonce::error::sqlstate_of(e).is_some_and(|code| code == "25006" || code.starts_with("53"))
}

/// `Result` with the incident service's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_connection_from_the_pool_is_unavailable() {
        let code = |e: sqlx::Error| Error::from(e).code();
        assert_eq!(code(sqlx::Error::PoolTimedOut), "unavailable");
        assert_eq!(code(sqlx::Error::PoolClosed), "unavailable");
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(code(sqlx::Error::Io(refused)), "unavailable");
        assert_eq!(code(sqlx::Error::RowNotFound), "internal");
    }
}
