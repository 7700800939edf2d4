//! The lab's scenarios, each written once: its schema, its statements and
//! the typed outcome of its writes. The race, the bench and chaos drive the
//! same scenario and differ only in how they schedule it (step by step
//! with lock waits seen, a closed loop under load, a seeded schedule with
//! faults), so a fix or a bug in the scenario shows in all three at once.

pub mod guard;
pub(crate) mod sequence;
