//! pgonce: database safeguards that keep invariants true for queue-driven
//! workers on PostgreSQL, whose messages arrive at least once, sometimes
//! twice, sometimes concurrently.
//!
//! # Layout
//!
//! * [`migrate`]: the embedded schema (`pgonce` schema).
//!
//! The patterns (advisory locks, guarded writes, scoped sequences, jobs,
//! idempotency keys, the event store and the queue) each live in a module of
//! their own, with their SQL beside them.

mod migrate;

pub use migrate::{MIGRATOR, migrate};
