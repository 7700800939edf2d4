//! The incident service built on pgonce (seed 000): policies are evaluated
//! against entities by queue workers, which may create incidents. A worker
//! reads what its decision depends on ([`store::observe`]), evaluates slowly
//! with no connection held, and creates the incident through a pgonce
//! [`Guard`](pgonce::Guard) ([`store::create_incident`]), so that a policy
//! that allows one OPEN incident per entity never gets two (invariant I1),
//! even when the queue delivers a message twice and two workers race.
//!
//! The service knows nothing of the guard's SQL; the library knows nothing
//! of incidents.
//!
//! # Layout
//!
//! * [`migrate`]: the service's schema (`incidents` schema, versions 1001+).
//! * [`store`]: reading and creating incidents.

mod migrate;
pub mod store;

pub use migrate::{MIGRATOR, migrate};
pub use store::{Observed, create_incident, incident_guard, observe, singleton_violations};
