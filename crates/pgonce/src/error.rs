//! The library's one error type. Outcomes that are not bugs (a conflict, an
//! already-handled message, a lost lease, a lock wait that timed out, a
//! statement canceled by its timeout), and the causes a caller can name
//! (input refused before any statement, a stale receipt, a queue not found,
//! a queue backend unreachable or refusing, a misconfigured pooler), are
//! named variants a caller matches on; any other database error is
//! `Database`.

use std::time::Duration;

use crate::guard::ReadSet;
use crate::job::JobStatus;
use crate::lock::LockKey;
use crate::pooler::PoolerProblem;

/// Errors of every pgonce operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A bounded lock wait ran out. The transaction is still usable: the wait
    /// ran in a subtransaction that was rolled back.
    #[error("advisory lock {key} not granted within {waited:?}")]
    LockTimeout {
        /// The advisory key that was not granted.
        key: LockKey,
        /// The bounded wait that ran out (the configured timeout).
        waited: Duration,
    },

    /// A guarded write found the read set changed since the decision and
    /// wrote nothing. Not a bug: another worker acted first; re-evaluate.
    #[error(
        "guard {guard}: read set changed (expected {expected}, found {found}); nothing written"
    )]
    Conflict {
        /// The guard's name ([`crate::Guard::name`]).
        guard: String,
        /// The read set the decision was based on.
        expected: ReadSet,
        /// The read set re-read under the entity's lock.
        found: ReadSet,
    },

    /// PostgreSQL aborted the transaction to keep it serializable (SQLSTATE
    /// 40001) or broke a deadlock (40P01). Retrying the whole transaction is
    /// the remedy.
    #[error("transaction aborted by PostgreSQL ({sqlstate}); retry it: {message}")]
    SerializationFailure {
        /// `40001` (serialization failure) or `40P01` (deadlock detected).
        sqlstate: String,
        /// PostgreSQL's message.
        message: String,
    },

    /// A wait for a lock (a row another transaction is changing: the same
    /// job, idempotency key or processed-message key; a table someone's
    /// DDL holds) ran past the session's `lock_timeout` (SQLSTATE 55P03,
    /// `lock_not_available`): an operator's
    /// `ALTER ROLE ... SET lock_timeout`, or the database's. pgonce lifts
    /// that bound only for the waits it documents as lasting as long as
    /// they take (the advisory locks of [`crate::lock`], a guard, an event
    /// append, a sequence's take, a queue send, a migration run); every
    /// other wait keeps it. Nothing of the statement is written; the
    /// transaction it ran in is aborted (roll it back; dropping it does).
    /// Not a bug: running it again once the other transaction has ended
    /// goes through, or meets the outcome that transaction left (a
    /// job already handled, a key already processed).
    #[error("lock not granted within the session's lock_timeout ({message}); nothing written")]
    LockNotAvailable {
        /// PostgreSQL's message ("canceling statement due to lock
        /// timeout").
        message: String,
    },

    /// PostgreSQL canceled the statement (SQLSTATE 57014,
    /// `query_canceled`): the session's `statement_timeout` ran out (an
    /// operator's `ALTER ROLE ... SET statement_timeout`, the ceiling on
    /// every wait, lock waits included), or a cancel request stopped it
    /// (`pg_cancel_backend`, a client's cancel). PostgreSQL reports both
    /// with this one code; `message` says which, in the server's language.
    /// Not a bug: nothing of the statement is written, and the transaction
    /// it ran in is aborted (roll it back; dropping it does). After a
    /// timeout, running the transaction again may go through once what it
    /// waited for is released; a cancel was someone's decision to stop it.
    #[error("statement canceled by PostgreSQL ({message}); nothing of it was written")]
    QueryCanceled {
        /// PostgreSQL's message ("canceling statement due to statement
        /// timeout", "... due to user request").
        message: String,
    },

    /// The transaction's isolation level cannot make the operation correct
    /// (a scoped sequence's max + 1, or a guard's re-read, under a snapshot
    /// that may predate its lock). Nothing was written, and nothing was
    /// locked but a guard's key (`strategy` `guard`), which the rollback
    /// releases; begin the transaction with `needed` and retry.
    #[error("{strategy} needs isolation level {needed}, the transaction runs at {found}")]
    WrongIsolation {
        /// The strategy that refused, by its name.
        strategy: &'static str,
        /// The isolation level it needs, upper case (`READ COMMITTED`).
        needed: &'static str,
        /// The transaction's level, as `current_setting('transaction_isolation')`
        /// reports it.
        found: String,
    },

    /// An operation that must end the transaction was handed a nested one (a
    /// savepoint, `depth` > 1): releasing a savepoint commits nothing, so the
    /// operation could not keep its promise. Nothing was locked or written;
    /// the savepoint was rolled back and the outer transaction is untouched.
    /// Call it with the top-level transaction.
    #[error("{operation} needs the top-level transaction, got a savepoint at depth {depth}")]
    NestedTransaction {
        /// The operation that refused.
        operation: &'static str,
        /// The transaction's nesting depth (1 is the top level).
        depth: usize,
    },

    /// A scoped number was already committed by another transaction (the
    /// unique index on (scope, number) rejected the row). The transaction was
    /// rolled back; nothing of it is committed.
    #[error("number {number} of scope {scope} in {sequence} is already taken")]
    NumberTaken {
        /// The sequence's name.
        sequence: String,
        /// The scope the number was taken in, as text.
        scope: String,
        /// The number already committed.
        number: i64,
    },

    /// The scope's next number is past what its number column holds: the
    /// scope has used every number. Its transaction is aborted; nothing of
    /// it is committed.
    #[error("scope {scope} of {sequence} is exhausted: its next number is past its column's type")]
    SequenceExhausted {
        /// The sequence's name.
        sequence: String,
        /// The exhausted scope, as text.
        scope: String,
    },

    /// An event store append whose condition failed: events matching the
    /// condition's query exist after its `after` position (anywhere, when it
    /// had none). Nothing was appended. `matching` holds the first positions
    /// found (at most 16), lowest first.
    #[error(
        "append condition failed: events {matching:?} match the condition's query after position {after:?}"
    )]
    AppendConditionFailed {
        /// The condition's `after` position.
        after: Option<i64>,
        /// Positions of matching events, lowest first, at most 16.
        matching: Vec<i64>,
    },
    /// A conditional transition matched no row: the job was not in the
    /// expected state, so another delivery already handled it (or it does
    /// not exist). Not a failure: log it at debug and acknowledge the message.
    /// From [`crate::job::claim`] it means the job is terminal (`completed` or
    /// `dead`, the claim's own doing when it met a lease that ran out on the
    /// job's last attempt) or does not exist; a job merely in someone else's
    /// hands is [`Error::JobBusy`] instead.
    #[error("job {job_id} already handled (it was not {expected})")]
    AlreadyHandled {
        /// The job.
        job_id: i64,
        /// The status the transition required (`pending` for a claim).
        expected: &'static str,
    },

    /// A claim found the job not terminal but not claimable either: another
    /// delivery holds it (`processing`), it waits for a retry (`failed`), or
    /// it is not due yet (`pending` with a later `run_at`). Unlike
    /// [`Error::AlreadyHandled`] the work is not done: do not acknowledge the
    /// message. Leave it to come back (at `not_before` at the earliest, when
    /// the lease expires or the retry is due), so that if the current holder
    /// crashes the reaped job still has a message to drive it.
    #[error("job {job_id} is {status}, not claimable before {not_before}; keep the message")]
    JobBusy {
        /// The job.
        job_id: i64,
        /// Its status when the claim lost.
        status: JobStatus,
        /// The earliest time it can be claimed: its lease's end or its
        /// `run_at` (database clock).
        not_before: time::OffsetDateTime,
    },

    /// An operator retry of a job that is not dead (`status`), or that does
    /// not exist (`status: None`). Nothing was written. A concurrent retrier
    /// that got there first leaves the job `pending` (or further along).
    #[error("job {job_id} is not dead ({status:?}); nothing retried")]
    JobNotDead {
        /// The job.
        job_id: i64,
        /// Its status; `None` when no such job exists.
        status: Option<JobStatus>,
    },

    /// A lease (a job claim, an idempotency key hold) is no longer the
    /// current one: it expired and was reaped or taken over. Nothing was
    /// written; the new owner's outcome stands.
    #[error("lease lost on {resource}: it was taken over or released")]
    LeaseLost {
        /// What the lease was on (`job 17`, `idempotency key scope/key`).
        resource: String,
    },

    /// An idempotency key was reused for a different request (another
    /// fingerprint). The stored request is untouched.
    #[error("idempotency key {key:?} was used for a different request")]
    IdempotencyMismatch {
        /// The reused key.
        key: String,
    },

    /// An idempotency key is held by a request still in progress (its hold
    /// has not expired). Retry after the hold expires.
    #[error("idempotency key {key:?} is held by a request in progress")]
    IdempotencyInProgress {
        /// The held key.
        key: String,
    },

    /// A value was rejected before reaching the database.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// What was rejected (`job kind`, `message`, `guard name`).
        what: &'static str,
        /// Why, in words a caller can show.
        why: String,
    },

    /// A queue receipt handle no longer names the delivery it was issued for:
    /// the message was received again since (its visibility timeout ran
    /// out), moved to a dead-letter queue, redriven, purged or deleted. Also
    /// for a receipt another queue issued, or a malformed one. Nothing was
    /// deleted or extended. Another consumer may now own the message.
    #[error("stale receipt {receipt}: the message was redelivered, moved or deleted since")]
    StaleReceipt {
        /// The receipt as given.
        receipt: String,
    },

    /// A [`crate::Queue::delete_batch`] that the backend sends in several
    /// requests (Amazon SQS: 10 receipts each) ended part way: a request
    /// failed, or the server refused receipts for a reason other than
    /// staleness (`cause`: the first such failure). What earlier requests
    /// deleted stays deleted: every receipt of the batch in neither
    /// `stale` nor `undone` was deleted. The PostgreSQL queue deletes a
    /// batch in one statement and never returns this.
    #[error(
        "delete_batch ended part way: {} of its receipts not known to be deleted: {cause}",
        undone.len()
    )]
    DeleteBatchIncomplete {
        /// The receipts found stale, as the call's `Ok` lists them, in
        /// input order: their messages untouched.
        stale: Vec<crate::queue::Receipt>,
        /// The receipts not known to be deleted, in input order: those of
        /// the request that failed (which may have taken effect, as after
        /// [`Error::Unavailable`]), those the server refused, and those of
        /// the requests not sent after the failure. Deleting them again is
        /// the remedy: one whose message is gone already is reported
        /// stale, or deletes nothing.
        undone: Vec<crate::queue::Receipt>,
        /// The first failure: a request's error, or a refused receipt's.
        cause: Box<Error>,
    },

    /// A [`crate::Queue::send_batch`] that the backend sends in several
    /// requests (Amazon SQS: 10 messages each) ended part way: a request
    /// failed, or the server refused messages of it (`cause`: the first
    /// such failure), and the requests after it were not sent. What went
    /// through stays sent: `sent` says which, with their ids, and `unsent`
    /// which messages to send again. The PostgreSQL queue sends a batch in
    /// one statement and never returns this.
    #[error(
        "send_batch ended part way: {} of its messages not known to be sent: {cause}",
        unsent.len()
    )]
    SendBatchIncomplete {
        /// One place per message of the batch, in input order: what the
        /// send of each that went through returned, as the call's `Ok`
        /// would; `None` for those not known to be sent.
        sent: Vec<Option<crate::queue::Sent>>,
        /// The places (input positions, ascending) of the messages not
        /// known to be sent, the `None`s of `sent`: those the server
        /// refused, those of a request that failed (which may have taken
        /// effect, as after [`Error::Unavailable`]) and those of the
        /// requests not sent after it. Sending them again is the remedy;
        /// one of a failed request that did take effect is then sent
        /// twice, on a standard queue (a FIFO queue drops it within its
        /// deduplication window, given a deduplication id).
        unsent: Vec<usize>,
        /// The first failure: a request's error, or a refused message's.
        cause: Box<Error>,
    },

    /// The named queue does not exist.
    #[error("queue {name:?} does not exist")]
    QueueNotFound {
        /// The queue's name.
        name: String,
    },

    /// A send to the PostgreSQL queue found the queue changed under it at
    /// every one of its `attempts`: its content-based deduplication turned
    /// over between the handle's read of it and the send (each attempt
    /// reads it again), or, for a single message with a deduplication id,
    /// another sender's claim of the id kept committing after the
    /// attempt's snapshot. Nothing was sent, one message or a batch.
    /// Sending again is the remedy, once the queue's settings stop
    /// changing.
    #[error("queue {queue:?} changed under each of {attempts} attempts to send; nothing sent")]
    QueueChangedDuringSend {
        /// The queue's name.
        queue: String,
        /// The attempts made.
        attempts: u32,
    },

    /// A purge refused because an earlier purge of the queue is under way
    /// (Amazon SQS takes one purge per queue per 60 s, the time it may take
    /// to delete the messages). This call deleted nothing: the earlier
    /// purge deletes the messages sent before it began, and may or may not
    /// delete those sent since, so a caller that needs them gone purges
    /// again once it is over (60 s after it began at most).
    #[error("a purge of queue {queue:?} is under way; purge again once it is over")]
    PurgeInProgress {
        /// The queue's name.
        queue: String,
    },

    /// A message (its body and attributes) or a batch over the backend's
    /// size limit; nothing was sent.
    #[error("message of {size} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// The message's (or the batch's) size in bytes, as the backend
        /// counts it.
        size: usize,
        /// The limit in bytes.
        max: usize,
    },

    /// A queue backend other than PostgreSQL could not be reached or did not
    /// answer within its operation timeout (connection refused, DNS, TLS,
    /// timeout). Whether the request took effect is unknown: a send may have
    /// happened, so retry with a deduplication id where that matters.
    #[error("{backend} unavailable: {reason}")]
    Unavailable {
        /// The backend (`sqs`).
        backend: &'static str,
        /// What went wrong, as the client library reported it.
        reason: String,
    },

    /// A queue backend other than PostgreSQL answered with an error pgonce
    /// has no variant for (`code` is the backend's own error code). A
    /// server error (SQS's 5xx) says nothing of whether the request took
    /// effect: a send to a standard queue that fails so may have happened,
    /// as with [`Error::Unavailable`], and pgonce does not send it again.
    #[error("{backend} refused the request ({code}): {message}")]
    Backend {
        /// The backend (`sqs`).
        backend: &'static str,
        /// The backend's error code.
        code: String,
        /// The backend's message.
        message: String,
    },

    /// A connection pooler between pgonce and PostgreSQL is not set up the
    /// way pgonce needs (see [`PoolerProblem`]): not a bug of the caller's
    /// and not cured by retrying; the text names the cause, the fix, and the
    /// message that showed it (PgBouncer's, PostgreSQL's or sqlx's). Whether
    /// the failed call took effect is unknown only for
    /// [`PoolerProblem::Notifications`] (the answer was lost mid-query);
    /// the others failed before the statement ran.
    #[error("connection pooler: {problem} ({message}); {}", problem.fix())]
    Pooler {
        /// Which misconfiguration it is.
        problem: PoolerProblem,
        /// The message that showed it, as the pooler, PostgreSQL or sqlx
        /// worded it.
        message: String,
    },

    /// Any other database error. Its text is PostgreSQL's message and
    /// SQLSTATE, once (see [`describe`]); the `sqlx::Error` is in the
    /// variant, not repeated as the error's source.
    #[error("database error: {}", describe(.0))]
    Database(sqlx::Error),
}

/// One line for a sqlx error: PostgreSQL's message and SQLSTATE (without
/// the server's C source line sqlx's own text ends with), and the text of
/// what it wraps (a migration's error) once, not once per layer.
pub fn describe(e: &sqlx::Error) -> String {
    use sqlx::migrate::MigrateError;
    match e {
        sqlx::Error::Database(d) => match d.code() {
            Some(code) => format!("{} (SQLSTATE {code})", d.message()),
            None => d.message().to_owned(),
        },
        sqlx::Error::Migrate(m) => match &**m {
            MigrateError::Execute(inner) => {
                format!("while executing migrations: {}", describe(inner))
            }
            MigrateError::ExecuteMigration(inner, version) => {
                format!("while executing migration {version}: {}", describe(inner))
            }
            // sqlx's own wording ("previously applied but is missing in
            // the resolved migrations") does not say what it means here.
            MigrateError::VersionMissing(version) => format!(
                "the database has migration {version}, which this build does not know: \
                 a newer pgonce migrated it; run that version, or a newer one"
            ),
            // Ours, not a migration source's ("while resolving migrations").
            MigrateError::Source(inner)
                if inner.is::<crate::migrate::SchemaMissing>()
                    || inner.is::<crate::migrate::NotUtf8>() =>
            {
                inner.to_string()
            }
            other => other.to_string(),
        },
        other => other.to_string(),
    }
}

impl From<sqlx::migrate::MigrateError> for Error {
    /// A failed migration, as [`Error::Database`].
    fn from(e: sqlx::migrate::MigrateError) -> Error {
        Error::Database(sqlx::Error::Migrate(Box::new(e)))
    }
}

/// SQLSTATE codes pgonce maps to variants (see [`Error::from`]).
pub mod sqlstate {
    /// `serialization_failure`.
    pub const SERIALIZATION_FAILURE: &str = "40001";
    /// `deadlock_detected`.
    pub const DEADLOCK_DETECTED: &str = "40P01";
    /// `query_canceled`, raised when `statement_timeout` expires or a
    /// cancel request (`pg_cancel_backend`) stops a statement.
    pub const QUERY_CANCELED: &str = "57014";
    /// `lock_not_available`, raised when `lock_timeout` expires.
    pub const LOCK_NOT_AVAILABLE: &str = "55P03";
    /// `unique_violation`.
    pub const UNIQUE_VIOLATION: &str = "23505";
    /// `foreign_key_violation`.
    pub const FOREIGN_KEY_VIOLATION: &str = "23503";
    /// `numeric_value_out_of_range`.
    pub const NUMERIC_VALUE_OUT_OF_RANGE: &str = "22003";
    /// `undefined_function`, raised for a missing function or operator.
    pub const UNDEFINED_FUNCTION: &str = "42883";
}

/// The SQLSTATE of a database error, if it is one.
pub fn sqlstate_of(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

/// Whether PostgreSQL's error `e` says it refused or ended the session:
/// a connection exception (SQLSTATE class 08), the server shutting down
/// or starting up (57P01 `admin_shutdown`, 57P02 `crash_shutdown`, 57P03
/// `cannot_connect_now`), or any error of severity FATAL or PANIC, which
/// ends the session whatever its code (`idle_in_transaction_session_timeout`'s
/// 25P03 and `idle_session_timeout`'s 57P05 among them). The session's
/// open transaction rolled back with it. False for an error that is not
/// PostgreSQL's (a socket that failed is the caller's to judge).
pub fn session_ended(e: &sqlx::Error) -> bool {
    let Some(d) = e.as_database_error() else {
        return false;
    };
    let by_code = d.code().is_some_and(|code| {
        code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03")
    });
    let by_severity = d
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some_and(|pg| {
            matches!(
                pg.severity(),
                sqlx::postgres::PgSeverity::Fatal | sqlx::postgres::PgSeverity::Panic
            )
        });
    by_code || by_severity
}

impl From<sqlx::Error> for Error {
    /// The one place SQLSTATEs become variants.
    fn from(e: sqlx::Error) -> Error {
        if let Some(problem) = PoolerProblem::of(&e) {
            return Error::Pooler {
                problem,
                message: describe(&e),
            };
        }
        match sqlstate_of(&e).as_deref() {
            Some(code @ (sqlstate::SERIALIZATION_FAILURE | sqlstate::DEADLOCK_DETECTED)) => {
                Error::SerializationFailure {
                    sqlstate: code.to_string(),
                    message: database_message(&e),
                }
            }
            Some(sqlstate::LOCK_NOT_AVAILABLE) => Error::LockNotAvailable {
                message: database_message(&e),
            },
            Some(sqlstate::QUERY_CANCELED) => Error::QueryCanceled {
                message: database_message(&e),
            },
            _ => Error::Database(e),
        }
    }
}

/// PostgreSQL's message of a database error (empty for other errors).
fn database_message(e: &sqlx::Error) -> String {
    e.as_database_error()
        .map(|d| d.message().to_string())
        .unwrap_or_default()
}

impl Error {
    /// An [`Error::Invalid`]: `what` was refused, for `why`.
    pub(crate) fn invalid(what: &'static str, why: impl Into<String>) -> Error {
        Error::Invalid {
            what,
            why: why.into(),
        }
    }

    /// True for failures that retrying the whole transaction can cure:
    /// [`Error::SerializationFailure`], and
    /// [`Error::QueueChangedDuringSend`] (the queue's settings changed
    /// under each attempt; nothing was sent). Not [`Error::QueryCanceled`] nor
    /// [`Error::LockNotAvailable`]: retried without a pause, a statement
    /// cut by the operator's `statement_timeout` or `lock_timeout` waits
    /// that bound out again, and a canceled one was meant to stop; whether
    /// and when to run it again is the caller's call.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::SerializationFailure { .. } | Error::QueueChangedDuringSend { .. }
        )
    }
}

/// `Result` with pgonce's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
