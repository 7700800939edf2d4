//! pgonce: database safeguards that keep invariants true for queue-driven
//! workers on PostgreSQL, whose messages arrive at least once, sometimes
//! twice, sometimes concurrently.
//!
//! # Layout
//!
//! * [`error`]: the one error type; SQLSTATEs mapped in one place.
//! * [`lock`]: transaction-level advisory locks with 64-bit keys.
//! * [`migrate`]: the embedded schema (`pgonce` schema).
//! * [`queue`]: the [`Queue`] trait (SQS semantics), the PostgreSQL queue
//!   [`PgQueue`], the worker runtime [`Worker`], and the conformance suite
//!   every backend runs.
//!
//! The patterns (advisory locks, guarded writes, scoped sequences, jobs,
//! idempotency keys, the event store and the queue) each live in a module of
//! their own, with their SQL beside them.

pub mod error;
pub mod lock;
mod migrate;
pub mod queue;

pub use error::{Error, Result};
pub use lock::LockKey;
pub use migrate::{MIGRATOR, migrate};
pub use queue::{
    AckPolicy, Handler, HandlerError, PgQueue, PgQueueOptions, Queue, QueueAttributes, QueueStats,
    Receipt, ReceiveRequest, Received, SendMessage, Sent, Worker, WorkerConfig, WorkerCounters,
};
