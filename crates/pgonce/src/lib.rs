//! pgonce: database safeguards that keep invariants true for queue-driven
//! workers on PostgreSQL, whose messages arrive at least once, sometimes
//! twice, sometimes concurrently.
//!
//! # Layout
//!
//! * [`error`]: the one error type; SQLSTATEs mapped in one place.
//! * [`guard`]: write-if-unchanged: lock, re-read, compare, write (seed 000).
//! * [`lock`]: transaction-level advisory locks with 64-bit keys.
//! * [`migrate`]: the embedded schema (`pgonce` schema).
//!
//! The patterns (advisory locks, guarded writes, scoped sequences, jobs,
//! idempotency keys, the event store and the queue) each live in a module of
//! their own, with their SQL beside them.

pub mod error;
pub mod guard;
pub mod lock;
mod migrate;

pub use error::{Error, Result};
pub use guard::{Guard, GuardConfig, Isolation, ReadSet};
pub use lock::LockKey;
pub use migrate::{MIGRATOR, migrate};
