//! `[queue]`: which queue the pipeline reads and the API writes
//! observations to: the PostgreSQL queue inside the service's own database
//! (the default), or Amazon SQS (`[queue.sqs]`).

use std::time::Duration;

use pgonce_sqs::SqsConfig;
use serde::Deserialize;

use super::{ConfigError, invalid};

/// Where observations are queued.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueBackend {
    /// `pgonce.queue_message` in the service's database (the default).
    #[default]
    Postgres,
    /// An Amazon SQS FIFO queue (or a local server speaking its protocol).
    Sqs,
}

/// `[queue]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueSection {
    /// `backend`: `postgres` (default) or `sqs`.
    pub backend: QueueBackend,
    /// `[queue.sqs]`: read only with `backend = "sqs"`.
    pub sqs: SqsSection,
}

/// `[queue.sqs]`: the SQS queue and how to reach it. The visibility timeout
/// and the receive count before dead-lettering are `[pipeline]`'s
/// (`visibility_timeout`, `max_receive_count`), as for the PostgreSQL
/// queue. Credentials come from the standard AWS chain
/// (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, instance
/// and container roles), never from this file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SqsSection {
    /// `queue`: the observations queue, by name or by URL (its last path
    /// segment is the name). A FIFO queue: the name ends in `.fifo`; the
    /// message group is the entity, the deduplication id the producer's
    /// (5 minutes, fixed by SQS). Default `incidents-observations.fifo`.
    pub queue: String,
    /// `dead_letter_queue`: where observations go after
    /// `pipeline.max_receive_count` deliveries; FIFO too. Default
    /// `incidents-observations-dead.fifo`.
    pub dead_letter_queue: String,
    /// `create`: create both queues at start when missing (SQS keeps an
    /// existing queue whose attributes match and refuses one whose
    /// attributes differ). `false`: open them, and fail when either is
    /// missing. Default true.
    pub create: bool,
    /// `region`: overrides the standard configuration's (`AWS_REGION`,
    /// profiles); `us-east-1` when neither names one. Default none.
    pub region: Option<String>,
    /// `endpoint_url`: overrides the endpoint, for a local server such as
    /// moto or ElasticMQ (`http://127.0.0.1:5000`). Default none (the
    /// region's AWS endpoint, or `AWS_ENDPOINT_URL_SQS`).
    pub endpoint_url: Option<String>,
    /// `operation_timeout`: the longest one SQS call may take, retries
    /// included (a receive's long-poll wait comes on top); past it the call
    /// fails as unavailable. Default 10s; 100ms to 5m.
    #[serde(with = "humantime_serde")]
    pub operation_timeout: Duration,
}

impl Default for SqsSection {
    fn default() -> Self {
        SqsSection {
            queue: "incidents-observations.fifo".into(),
            dead_letter_queue: "incidents-observations-dead.fifo".into(),
            create: true,
            region: None,
            endpoint_url: None,
            operation_timeout: SqsConfig::default().operation_timeout,
        }
    }
}

impl SqsSection {
    /// The client configuration: the standard AWS chain with this
    /// section's overrides.
    pub fn sqs_config(&self) -> SqsConfig {
        SqsConfig {
            endpoint_url: self.endpoint_url.clone().filter(|u| !u.is_empty()),
            region: self.region.clone().filter(|r| !r.is_empty()),
            operation_timeout: self.operation_timeout,
            ..SqsConfig::default()
        }
    }

    /// The observations queue's name (`queue`, or the last segment of its
    /// URL).
    pub fn queue_name(&self) -> &str {
        queue_name(&self.queue)
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_name(&self) -> &str {
        queue_name(&self.dead_letter_queue)
    }

    /// What cannot work, naming the key. `max_receive_count` and
    /// `visibility` are `[pipeline]`'s, checked here against SQS's ranges.
    pub(super) fn validate(
        &self,
        max_receive_count: u32,
        visibility: Duration,
    ) -> Result<(), ConfigError> {
        for (key, name) in [
            ("queue.sqs.queue", self.queue_name()),
            ("queue.sqs.dead_letter_queue", self.dead_letter_name()),
        ] {
            let base = name.strip_suffix(".fifo").ok_or_else(|| {
                invalid(
                    key,
                    format!(
                        "{name:?}: the observations need a FIFO queue (per-entity order, \
                         deduplication ids), whose name ends in .fifo"
                    ),
                )
            })?;
            if base.is_empty()
                || name.len() > 80
                || !base
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(invalid(
                    key,
                    format!("{name:?}: SQS names are 1 to 80 of A-Z a-z 0-9 - _, then .fifo"),
                ));
            }
        }
        if self.queue_name() == self.dead_letter_name() {
            return Err(invalid(
                "queue.sqs.dead_letter_queue",
                "must differ from queue.sqs.queue",
            ));
        }
        if !(pgonce_sqs::MIN_OPERATION_TIMEOUT..=pgonce_sqs::MAX_OPERATION_TIMEOUT)
            .contains(&self.operation_timeout)
        {
            return Err(invalid(
                "queue.sqs.operation_timeout",
                "must be 100ms to 5m",
            ));
        }
        if let Some(url) = self.endpoint_url.as_deref().filter(|u| !u.is_empty())
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(invalid(
                "queue.sqs.endpoint_url",
                "must be an http:// or https:// URL",
            ));
        }
        // What else the client refuses (an https:// endpoint in a build
        // without TLS) is the section's.
        self.sqs_config()
            .validate()
            .map_err(|e| invalid("queue.sqs", e))?;
        if !(1..=1000).contains(&max_receive_count) {
            return Err(invalid("pipeline.max_receive_count", "SQS takes 1 to 1000"));
        }
        if visibility > Duration::from_secs(12 * 3600) {
            return Err(invalid(
                "pipeline.visibility_timeout",
                "SQS takes at most 12h",
            ));
        }
        Ok(())
    }
}

fn queue_name(queue: &str) -> &str {
    if queue.starts_with("http://") || queue.starts_with("https://") {
        queue
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(queue)
    } else {
        queue
    }
}
