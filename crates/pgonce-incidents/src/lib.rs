//! The incident service built on pgonce: observations of entities arrive on
//! a queue; workers evaluate the organization's policies against them and
//! open incidents, numbered per organization, notified once, each with a
//! timeline. An observation delivered twice must not open a duplicate
//! incident, and concurrent declarations in one organization must not share
//! a number.
//!
//! Which pgonce safeguard keeps which invariant:
//!
//! | invariant | safeguard | where |
//! |---|---|---|
//! | I1: a singleton policy never has two OPEN incidents for one entity | guarded write (entity lock, re-read, compare) | [`Service::open_from_pipeline`] |
//! | I2: incident numbers are 1..n per organization | scoped sequence, number taken last | [`Service`] (module docs) |
//! | I3: each incident is notified once | notification job in the creating transaction; two-phase claim; idempotency key on the webhook | [`notifier`] |
//! | I6: no observation lost | queue: delete only after success; ledger of processed messages | [`pipeline`] |
//!
//! The service chooses strategies and knows nothing of their SQL; the
//! library knows nothing of incidents.
//!
//! # Layout
//!
//! * [`model`]: the domain types and their validation.
//! * [`store`]: organizations, API keys, entities, policies, settings.
//! * [`service`]: incidents: creation (guarded or plain), declaration by
//!   hand, lifecycle, timeline, feed.
//! * [`pipeline`]: the queue handler and the evaluator.
//! * [`notifier`]: sends notifications (the test kit has a receiver to send
//!   them to).
//! * [`runtime`]: workers, notifier, reaper and re-driver, started and
//!   stopped together.
//! * [`invariants`]: I1, I2, I3, I6 checked in the database.
//! * [`config`]: the deployable configuration, layered (defaults, TOML,
//!   environment).
//! * [`api`]: the HTTP API ([`api::router`]), keys scoped to their
//!   organization, JSON errors, `/openapi.json`.
//! * [`migrate`](migrate()): the service's schema (`incidents`, versions 1001+).

#![warn(missing_docs)]

#[cfg(test)]
mod allocations;
pub mod api;
pub mod config;
pub mod error;
pub mod invariants;
mod migrate;
pub mod model;
pub mod notifier;
pub mod pipeline;
pub mod runtime;
pub mod service;
pub mod store;

pub use error::{Error, Result};
pub use migrate::{MIGRATOR, SCHEMA, migrate, newer_version};
pub use notifier::{Notifier, NotifierConfig};
pub use pipeline::{ObservationHandler, SimulatedEvaluator, SimulatedEvaluatorConfig};
pub use service::{FeedPage, Service, ServiceConfig, WritePath};
