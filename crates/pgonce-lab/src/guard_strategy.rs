//! How the incident pipeline's worker (read "no open incident", evaluate for a
//! while, create one) keeps at most one open incident per entity: the
//! strategies `pgonce race guard` replays step by step and `pgonce bench
//! guard` measures under load, defined once for both.

/// One way to make the worker's read-evaluate-write safe (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardStrategy {
    /// The naive code: read in one transaction, write in another.
    TwoTransactions,
    /// Read, evaluate and write in one REPEATABLE READ transaction.
    RepeatableRead,
    /// Read, evaluate and write in one SERIALIZABLE transaction, retried.
    Serializable,
    /// A session-level advisory lock held across the evaluation.
    SessionLock,
    /// Two transactions behind a partial unique index.
    UniqueIndex,
    /// pgonce's guard: short read, evaluation with no connection held,
    /// then lock, re-read, compare and write.
    Guard,
    /// The guard with BEGIN and its lock in separate round trips
    /// (`Guard::begin`, then `GuardedTransaction::check`).
    GuardBeginCheck,
}

impl GuardStrategy {
    pub fn name(self) -> &'static str {
        match self {
            GuardStrategy::TwoTransactions => "two-transactions",
            GuardStrategy::RepeatableRead => "repeatable-read",
            GuardStrategy::Serializable => "serializable",
            GuardStrategy::SessionLock => "session-lock",
            GuardStrategy::UniqueIndex => "unique-index",
            GuardStrategy::Guard => "guard",
            GuardStrategy::GuardBeginCheck => "guard-begin-check",
        }
    }

    /// Whether the strategy is expected to keep one open incident when two
    /// workers race on one entity.
    pub fn safe(self) -> bool {
        !matches!(
            self,
            GuardStrategy::TwoTransactions | GuardStrategy::RepeatableRead
        )
    }
}
