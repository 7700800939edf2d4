//! pgonce: database safeguards that keep invariants true for queue-driven
//! workers on PostgreSQL, whose messages arrive at least once, sometimes
//! twice, sometimes concurrently.
//!
//! # Layout
//!
//! * [`error`]: the one error type; SQLSTATEs mapped in one place.
//! * [`lock`]: transaction-level advisory locks with 64-bit keys.
//! * [`migrate`]: the embedded schema (`pgonce` schema).
//! * [`job`]: conditional transitions, fenced leases, the reaper and DB-driven
//!   retry (P3).
//! * [`dedupe`]: processed-message keys and idempotency keys (P4).
//!
//! The patterns (advisory locks, guarded writes, scoped sequences, jobs,
//! idempotency keys, the event store and the queue) each live in a module of
//! their own, with their SQL beside them.

pub mod dedupe;
pub mod error;
pub mod job;
pub mod lock;
mod migrate;
mod service;

pub use error::{Error, Result};
pub use lock::LockKey;
pub use migrate::{MIGRATOR, migrate};
