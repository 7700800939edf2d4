//! pgonce: database safeguards that keep invariants true for queue-driven
//! workers on PostgreSQL, whose messages arrive at least once, sometimes
//! twice, sometimes concurrently.
//!
//! # Layout
//!
//! * [`error`]: the one error type; SQLSTATEs mapped in one place.
//! * [`guard`]: write-if-unchanged: lock, re-read, compare, write (P1,
//!   against the duplicate-incident race).
//! * [`lock`]: transaction-level advisory locks with 64-bit keys.
//! * [`events`]: a DCB event store; conditional appends under three
//!   strategies, decision reads, catch-up subscriptions (P5, I5).
//! * [`mod@migrate`]: the embedded schema (`pgonce` schema) and a migration
//!   runner that works behind a transaction-mode pooler.
//! * `sequence`: per-scope gapless numbers taken inside the caller's
//!   transaction ([`Sequence`], P2).
//! * [`queue`]: the [`Queue`] trait (SQS semantics), the PostgreSQL queue
//!   [`PgQueue`], the worker runtime [`Worker`], and (feature
//!   `conformance`) the conformance suite every backend runs.
//! * [`job`]: conditional transitions, fenced leases, the reaper and DB-driven
//!   retry (P3).
//! * [`dedupe`]: processed-message keys and idempotency keys (P4).
//! * `pooler`: how a connection pooler set up wrongly shows
//!   ([`PoolerProblem`], [`Error::Pooler`]).
//! * [`maintenance`]: the loop that deletes rows past their retention
//!   (finished jobs, dead-letter messages, dedup claims, keys).
//! * [`json`]: what a `jsonb` column can store and read back, checked
//!   before a value is written.
//! * [`service`]: how the background loops (reaper, re-driver, collector,
//!   maintenance) tell of their failed passes, for a loop of one's own too.
//! * [`begin`]: a transaction begun at a stated [`IsolationLevel`], never
//!   at the database's default.
//!
//! The patterns (advisory locks, guarded writes, scoped sequences, jobs,
//! idempotency keys, the event store and the queue) each live in a module of
//! their own, with their SQL beside them.

#![warn(missing_docs)]

pub mod dedupe;
mod duration;
pub mod error;
pub mod events;
pub mod guard;
pub mod job;
pub mod json;
mod listen;
pub mod lock;
pub mod maintenance;
pub mod migrate;
mod pooler;
pub mod queue;
mod sequence;
pub mod service;
mod text;
mod timestamp;
mod transaction;

pub use error::{Error, Result};
pub use events::{
    AppendCondition, AppendStrategy, Event, EventStore, EventStoreConfig, Query, QueryItem,
    StoredEvent,
};
pub use guard::{Guard, GuardConfig, GuardedTransaction, Isolation, ReadSet};
pub use listen::Listen;
pub use lock::LockKey;
pub use migrate::{MIGRATOR, migrate};
pub use pooler::PoolerProblem;
pub use queue::{
    AckPolicy, Handler, HandlerError, PgQueue, PgQueueOptions, Queue, QueueAttributes, QueueStats,
    Receipt, ReceiveRequest, Received, SendMessage, Sent, Worker, WorkerConfig, WorkerCounters,
};
pub use sequence::{
    Numbered, NumberedTable, ScopeValue, Sequence, SequenceConfig, Strategy as SequenceStrategy,
    Taken,
};
pub use transaction::{IsolationLevel, begin, begin_read_only};
