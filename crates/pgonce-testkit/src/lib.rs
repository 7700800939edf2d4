//! Test and demonstration support for pgonce: PostgreSQL servers to run
//! against, and a harness that drives several sessions step by step.
//!
//! # Layout
//!
//! * [`cluster`]: a throwaway PostgreSQL cluster from the installed
//!   binaries, removed on drop and when the process dies.
//! * [`server`]: the server to use (`DATABASE_URL` or a throwaway cluster)
//!   and scratch databases on it; [`fresh_database`] for tests, and
//!   [`fresh_migrated_database`] for tests that start from a schema.
//! * [`pooler`]: PgBouncer in transaction mode in front of a server.
//! * [`moto`]: a throwaway SQS server (moto) on a loopback port.
//! * [`interleave`]: step-by-step interleavings whose blocking steps are
//!   confirmed through `pg_blocking_pids`, never through sleeps, and a
//!   table held locked while a test's subject runs into it.
//! * [`logs`]: what a test's subject logs, kept for the test to count.
//! * [`webhook`]: a loopback webhook receiver that deduplicates by
//!   idempotency key and fails or answers late on purpose.
//! * [`proxy`]: a TCP proxy in front of a server that forwards new
//!   connections late or only when the test lets them through, and holds
//!   back the server's answer to a chosen message.
//! * [`wait`]: polling for a state a test awaits, bounded by [`FAILSAFE`]
//!   so that a state that never comes fails the test instead of hanging it.

#![warn(missing_docs)]

pub mod cluster;
pub mod interleave;
pub mod logs;
pub mod moto;
pub mod pooler;
pub mod proxy;
pub mod server;
pub mod wait;
pub mod webhook;

pub use cluster::{Cluster, ClusterError, ShutdownMode};
pub use interleave::{
    Blocked, BoxError, HarnessError, Interleaving, Session, Step, StepEvent, TableLock,
};
pub use moto::{Moto, MotoError};
pub use pooler::{Pooler, PoolerSetup};
pub use proxy::{FaultProxy, Forwarded, HeldAnswer, HeldConnection, NewConnections};
pub use server::{
    SchemaCatalog, ScratchDatabase, Server, ServerError, fresh_database,
    fresh_database_behind_pooler, fresh_migrated_database, fresh_migrated_database_behind_pooler,
    own_migrated_cluster, schema_catalog, shared_for_tests, shared_pooler_for_tests,
};
pub use wait::{FAILSAFE, wait_until, wait_until_every};
pub use webhook::{ReceiverFaults, ReceiverStats, WebhookError, WebhookReceiver};
