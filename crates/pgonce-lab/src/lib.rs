//! pgonce's lab: what proves the safeguards hold and measures what they
//! cost, kept apart from the product so that a deployed `pgonce serve`
//! links none of it.
//!
//! - [`race`] replays a race step by step under each strategy, driving
//!   several connections and waiting until one is seen blocked before the
//!   next step;
//! - [`bench`](mod@bench) compares strategies, and peer libraries, side by side in one
//!   run and prints ratios;
//! - [`demo`] runs the incident service end to end under redeliveries,
//!   duplicates and killed workers, and checks every invariant;
//! - [`chaos`] runs concurrent workloads under injected faults from a
//!   seeded schedule and checks their history against the invariants.
//!
//! The scenarios they drive are written once, in [`scenario`], each with
//! its schema, its statements and the typed outcome of its writes.
//!
//! Every run works in a scratch database ([`scratch`]) and ends in a
//! [`report::Report`]: tables for people, one JSON object for machines.
//! The `pgonce` command exposes all four when built with its `lab` feature.

#![warn(missing_docs)]

pub(crate) mod behind_pooler;
pub mod bench;
pub mod chaos;
pub mod demo;
pub mod incident_run;
pub(crate) mod plot;
pub mod race;
pub mod report;
pub mod scenario;
pub mod scratch;
