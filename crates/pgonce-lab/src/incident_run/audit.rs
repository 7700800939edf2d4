//! Where the run's messages are after it: [`QueueAudit`], one per queue
//! backend. The PostgreSQL queue answers from its table; SQS has no lookup
//! by id, so the audit reads both SQS queues through the API.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use pgonce::{Queue, ReceiveRequest, Received};
use pgonce_sqs::SqsQueue;
use sqlx::PgPool;

use super::UnprocessedMessage;

/// What the run's audit needs from a queue backend beyond [`Queue`].
pub trait QueueAudit {
    /// `postgres` or `sqs`, for the report.
    fn backend(&self) -> &'static str;

    /// The dead-letter queue's name, as `UnprocessedMessage::queue`
    /// gives it.
    fn dead_letter_queue(&self) -> &str;

    /// Whether [`pgonce::Sent::duplicate`] says a send was dropped by the
    /// deduplication id (SQS does not say).
    fn reports_duplicates(&self) -> bool;

    /// Where the messages `ids` (as sent) are now: in a queue, or nowhere
    /// (`queue: None`: deleted). Read-only, or leaves the queues as found.
    fn locate(
        &self,
        pool: &PgPool,
        ids: &[String],
    ) -> impl Future<Output = anyhow::Result<Vec<UnprocessedMessage>>> + Send;
}

/// The PostgreSQL queue: one read-only query over `pgonce.queue_message`.
#[derive(Debug, Clone)]
pub(crate) struct PgAudit {
    pub(crate) dead_letter_queue: String,
}

impl QueueAudit for PgAudit {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn dead_letter_queue(&self) -> &str {
        &self.dead_letter_queue
    }

    fn reports_duplicates(&self) -> bool {
        true
    }

    async fn locate(
        &self,
        pool: &PgPool,
        ids: &[String],
    ) -> anyhow::Result<Vec<UnprocessedMessage>> {
        Ok(sqlx::query_as(include_str!("sql/unprocessed_messages.sql"))
            .bind(ids)
            .fetch_all(pool)
            .await?)
    }
}

/// SQS: receives every visible message of the dead-letter queue, then of
/// the observations queue (in that order: a receive of the observations
/// queue can itself dead-letter a message that reached its maximum), and
/// makes each visible again. A message found in neither while the
/// observations queue still holds messages may be one of them (SQS shows
/// no in-flight message, nor a FIFO group's messages behind one already
/// received): it is reported there, pending rather than lost.
#[derive(Debug, Clone)]
pub struct SqsAudit {
    /// The observations queue the run sends to.
    pub observations: SqsQueue,
    /// Its dead-letter queue: malformed messages, and those received more
    /// than the maximum, end there.
    pub dead_letters: SqsQueue,
}

/// How long the audit hides what it reads: long enough that one pass sees
/// each message once.
const AUDIT_VISIBILITY: Duration = Duration::from_secs(30);

impl SqsAudit {
    /// Every visible message of `queue`, each then made visible again.
    async fn read_all(queue: &SqsQueue) -> anyhow::Result<Vec<Received>> {
        let mut all = Vec::new();
        loop {
            let batch = queue
                .receive(ReceiveRequest {
                    max_messages: 10,
                    wait: Duration::ZERO,
                    visibility: Some(AUDIT_VISIBILITY),
                })
                .await?;
            if batch.is_empty() {
                break;
            }
            all.extend(batch);
        }
        for m in &all {
            queue.change_visibility(&m.receipt, Duration::ZERO).await?;
        }
        Ok(all)
    }
}

impl QueueAudit for SqsAudit {
    fn backend(&self) -> &'static str {
        "sqs"
    }

    fn dead_letter_queue(&self) -> &str {
        self.dead_letters.name()
    }

    fn reports_duplicates(&self) -> bool {
        false
    }

    async fn locate(
        &self,
        _pool: &PgPool,
        ids: &[String],
    ) -> anyhow::Result<Vec<UnprocessedMessage>> {
        let mut found: BTreeMap<String, UnprocessedMessage> = BTreeMap::new();
        for queue in [&self.dead_letters, &self.observations] {
            for m in Self::read_all(queue).await? {
                found.entry(m.id.clone()).or_insert(UnprocessedMessage {
                    message_id: m.id,
                    queue: Some(queue.name().to_owned()),
                    // Less the audit's own receive.
                    receive_count: Some(m.receive_count.saturating_sub(1) as i32),
                    in_flight: Some(false),
                });
            }
        }
        let stats = self.observations.stats().await?;
        let held = stats.depth + stats.in_flight + stats.delayed > 0;
        Ok(ids
            .iter()
            .map(|id| {
                found.remove(id).unwrap_or_else(|| UnprocessedMessage {
                    message_id: id.clone(),
                    queue: held.then(|| self.observations.name().to_owned()),
                    receive_count: None,
                    in_flight: None,
                })
            })
            .collect())
    }
}
