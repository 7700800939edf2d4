//! Amazon SQS backend for pgonce's [`Queue`](pgonce::Queue) trait, so the
//! worker runtime ([`pgonce::Worker`]) runs on SQS as on PostgreSQL.
//!
//! # Layout
//!
//! * `config`: [`SqsConfig`], where SQS is and how long a call may take.
//! * `queue`: [`SqsClient`] (creates and opens queues) and [`SqsQueue`]
//!   (the trait on one queue; its docs list where SQS differs from the
//!   contract).
//! * `retry`: what the SDK may retry of a send: not, on a standard queue,
//!   a request SQS may have taken.
//! * `error`: SDK errors to [`pgonce::Error`] in one place. A call that
//!   cannot reach SQS within [`SqsConfig::operation_timeout`] fails with
//!   [`pgonce::Error::Unavailable`]; errors SQS returns that have no variant
//!   of their own are [`pgonce::Error::Backend`].
//!
//! # Pointing it at SQS
//!
//! Real SQS: build with the `tls` feature (HTTPS; off by default so the
//! default build carries no TLS stack; the `pgonce` command's `sqs-tls`
//! feature turns it on) and leave [`SqsConfig`]'s overrides
//! `None`: region, credentials and endpoint come from the standard AWS
//! configuration (`AWS_REGION`, `AWS_PROFILE`, `AWS_ACCESS_KEY_ID`, instance
//! and container roles, `AWS_ENDPOINT_URL_SQS`).
//!
//! A local server (moto's `moto_server`, ElasticMQ): plain HTTP, no feature
//! needed; [`SqsConfig::local`] sets the endpoint, region `us-east-1` and
//! dummy credentials.
//!
//! ```no_run
//! use pgonce::{Queue, QueueAttributes, SendMessage};
//! use pgonce_sqs::{SqsClient, SqsConfig};
//!
//! # async fn f() -> pgonce::Result<()> {
//! let sqs = SqsClient::connect(SqsConfig::local("http://127.0.0.1:5000")).await?;
//! let dlq = sqs.create_queue("orders-dlq", QueueAttributes::default()).await?;
//! let queue = sqs
//!     .create_queue("orders", QueueAttributes::default().dead_letter(dlq.name(), 5))
//!     .await?;
//! queue.send(SendMessage::new(r#"{"order": 17}"#)).await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod config;
mod error;
mod queue;
mod retry;

pub use config::{MAX_OPERATION_TIMEOUT, MIN_OPERATION_TIMEOUT, SqsConfig};
pub use queue::{SQS_DEDUP_WINDOW, SqsClient, SqsQueue};
