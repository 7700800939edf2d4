//! The history of a round: every operation's invocation and completion,
//! and every fault, in the order the driver saw them. The checker reads it
//! (with the tables) and nothing else the scenarios know.

use std::borrow::Borrow;

use serde::Serialize;
use serde_json::Value;

use super::schedule::Action;

/// How an operation ended, as far as its caller could tell.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub(crate) enum Outcome {
    /// Invoked, not yet completed (still blocked when the round ended).
    Pending,
    /// Completed; what it returned.
    Ok { value: Value },
    /// Failed with a typed error.
    Err { kind: ErrorKind, message: String },
    /// Not run: the task had nothing to run it on (a write without a read,
    /// a complete without a lease). Shrunk schedules produce these.
    Skipped,
}

/// Errors sorted into what the invariants care about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ErrorKind {
    Conflict,
    NumberTaken,
    StaleReceipt,
    LeaseLost,
    JobBusy,
    AlreadyHandled,
    InProgress,
    /// The pool had no connection to give within its acquire timeout.
    PoolTimeout,
    /// The connection or the server went away (terminated, restarted).
    Connection,
    Other,
}

impl ErrorKind {
    /// Sorts a pgonce error.
    pub(crate) fn of(error: &pgonce::Error) -> ErrorKind {
        use pgonce::Error as E;
        match error {
            E::Conflict { .. } => ErrorKind::Conflict,
            E::NumberTaken { .. } => ErrorKind::NumberTaken,
            E::StaleReceipt { .. } => ErrorKind::StaleReceipt,
            E::LeaseLost { .. } => ErrorKind::LeaseLost,
            E::JobBusy { .. } => ErrorKind::JobBusy,
            E::AlreadyHandled { .. } => ErrorKind::AlreadyHandled,
            E::IdempotencyInProgress { .. } => ErrorKind::InProgress,
            E::Database(e) => ErrorKind::of_sqlx(e),
            _ => ErrorKind::Other,
        }
    }

    /// Sorts a sqlx error.
    pub(crate) fn of_sqlx(error: &sqlx::Error) -> ErrorKind {
        match error {
            sqlx::Error::PoolTimedOut => ErrorKind::PoolTimeout,
            sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::PoolClosed => {
                ErrorKind::Connection
            }
            sqlx::Error::Database(d)
                if d.code()
                    .is_some_and(|c| c.starts_with("57P") || c.starts_with("08")) =>
            {
                ErrorKind::Connection
            }
            _ => ErrorKind::Other,
        }
    }
}

/// One operation or fault.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Entry {
    /// The operation's id, unique within the round; rows it writes carry it.
    pub(crate) op: i64,
    pub(crate) task: usize,
    pub(crate) action: Action,
    /// What the operation was called with (ids, receipts, keys).
    pub(crate) input: Value,
    /// The history's clock at invocation and at completion.
    pub(crate) invoked: u64,
    pub(crate) completed: Option<u64>,
    #[serde(flatten)]
    pub(crate) outcome: Outcome,
}

/// The round's history.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct History {
    entries: Vec<Entry>,
    clock: u64,
}

impl History {
    /// Records an invocation; returns its op id.
    pub(crate) fn invoke(&mut self, task: usize, action: Action, input: Value) -> i64 {
        self.clock += 1;
        let op = self.entries.len() as i64 + 1;
        self.entries.push(Entry {
            op,
            task,
            action,
            input,
            invoked: self.clock,
            completed: None,
            outcome: Outcome::Pending,
        });
        op
    }

    /// Records the completion of `op`.
    pub(crate) fn complete(&mut self, op: i64, outcome: Outcome) {
        self.clock += 1;
        let entry = &mut self.entries[(op - 1) as usize];
        entry.completed = Some(self.clock);
        entry.outcome = outcome;
    }

    /// Records the result of `op` from a pgonce call.
    pub(crate) fn finish<T: Serialize, E: Borrow<pgonce::Error>>(
        &mut self,
        op: i64,
        result: &Result<T, E>,
    ) {
        let outcome = match result {
            Ok(v) => Outcome::ok(v),
            Err(e) => Outcome::error(e.borrow()),
        };
        self.complete(op, outcome);
    }

    /// An operation invoked and completed at once.
    pub(crate) fn record(
        &mut self,
        task: usize,
        action: Action,
        input: Value,
        outcome: Outcome,
    ) -> i64 {
        let op = self.invoke(task, action, input);
        self.complete(op, outcome);
        op
    }

    /// Records a step the task could not run (what it acts on is not
    /// held, or the step does not belong to the scenario): no input, and
    /// not counted as an operation.
    pub(crate) fn skip(&mut self, task: usize, action: Action) -> i64 {
        self.record(task, action, Value::Null, Outcome::Skipped)
    }

    pub(crate) fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Operations (faults and skipped steps not counted).
    pub(crate) fn operations(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| !e.action.is_fault() && e.outcome != Outcome::Skipped)
            .count()
    }
}

impl Outcome {
    pub(crate) fn ok(value: impl Serialize) -> Outcome {
        Outcome::Ok {
            value: serde_json::to_value(value).unwrap_or(Value::Null),
        }
    }

    pub(crate) fn error(e: &pgonce::Error) -> Outcome {
        Outcome::Err {
            kind: ErrorKind::of(e),
            message: e.to_string(),
        }
    }

    pub(crate) fn sqlx(e: &sqlx::Error) -> Outcome {
        Outcome::Err {
            kind: ErrorKind::of_sqlx(e),
            message: e.to_string(),
        }
    }

    pub(crate) fn is_ok(&self) -> bool {
        matches!(self, Outcome::Ok { .. })
    }

    pub(crate) fn error_kind(&self) -> Option<ErrorKind> {
        match self {
            Outcome::Err { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    pub(crate) fn value(&self) -> Option<&Value> {
        match self {
            Outcome::Ok { value } => Some(value),
            _ => None,
        }
    }
}
