//! Where the run's messages are after it: [`QueueAudit`], one per queue
//! backend. The PostgreSQL queue answers from its table; SQS has no lookup
//! by id, so the audit reads both SQS queues through the API. And what the
//! webhook receiver accepted, per incident: [`DeliveryAudit`].

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;

use pgonce::{Queue, ReceiveRequest, Received};
use pgonce_sqs::SqsQueue;
use pgonce_testkit::webhook::AcceptedDelivery;
use serde::{Deserialize, Serialize};
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

/// I3 as the webhook receiver saw it, beside the database's view
/// ([`super::NotificationAudit`]): per incident the run opened, the
/// notifications the receiver accepted, one per idempotency key (a repeat
/// of a key it drops is not counted). Each incident must have exactly one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DeliveryAudit {
    /// Incidents the run opened.
    pub incidents: usize,
    /// Notifications the receiver accepted, all told.
    pub accepted: usize,
    /// A violation: incidents the receiver accepted more than one
    /// notification for, each under a key of its own.
    pub doubled: Vec<DoubledDelivery>,
    /// A violation: incidents whose notification the receiver never
    /// accepted, their notification job finished (completed or dead).
    pub missing: Vec<i64>,
    /// Not a violation, and not a success: incidents whose notification
    /// the receiver has not accepted while their job was still pending at
    /// the deadline (the database's view lists those jobs).
    pub pending_at_deadline: Vec<i64>,
    /// A violation: notifications accepted for an incident the run did
    /// not open, or whose body names no incident.
    pub strays: Vec<AcceptedDelivery>,
}

/// An incident the receiver accepted more than one notification for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DoubledDelivery {
    /// The incident.
    pub incident_id: i64,
    /// The keys of its accepted notifications, in the order accepted.
    pub keys: Vec<String>,
}

/// The part of a notification's body the audit reads.
#[derive(Deserialize)]
struct NotifiedIncident {
    incident_id: i64,
}

impl DeliveryAudit {
    /// Compares the receiver's log (`accepted`, as
    /// [`pgonce_testkit::webhook::WebhookReceiver::accepted`] gives it)
    /// with the incidents the run `opened`; `pending` are the incidents
    /// whose notification job was not terminal at the deadline.
    pub fn of(
        opened: &[i64],
        pending: &BTreeSet<i64>,
        accepted: &[AcceptedDelivery],
    ) -> DeliveryAudit {
        let mut keys_of: BTreeMap<i64, Vec<String>> =
            opened.iter().map(|id| (*id, Vec::new())).collect();
        let mut audit = DeliveryAudit {
            incidents: keys_of.len(),
            accepted: accepted.len(),
            ..DeliveryAudit::default()
        };
        for delivery in accepted {
            let incident = serde_json::from_str::<NotifiedIncident>(&delivery.body)
                .ok()
                .and_then(|n| keys_of.get_mut(&n.incident_id));
            match incident {
                Some(keys) => keys.push(delivery.key.clone()),
                None => audit.strays.push(delivery.clone()),
            }
        }
        for (incident_id, keys) in keys_of {
            match keys.len() {
                0 if pending.contains(&incident_id) => audit.pending_at_deadline.push(incident_id),
                0 => audit.missing.push(incident_id),
                1 => {}
                _ => audit.doubled.push(DoubledDelivery { incident_id, keys }),
            }
        }
        audit
    }

    /// No incident notified twice or never (its job finished), and no
    /// notification the run did not send. Incidents still pending are
    /// left to the caller's judgement.
    pub fn holds(&self) -> bool {
        self.doubled.is_empty() && self.missing.is_empty() && self.strays.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(key: &str, incident_id: i64) -> AcceptedDelivery {
        AcceptedDelivery {
            key: key.to_owned(),
            body: serde_json::json!({ "incident_id": incident_id, "title": "t" }).to_string(),
        }
    }

    #[test]
    fn a_receiver_log_with_an_incident_accepted_twice_fails_the_audit() {
        let accepted = [delivery("k1", 1), delivery("k2", 2), delivery("k3", 2)];
        let audit = DeliveryAudit::of(&[1, 2], &BTreeSet::new(), &accepted);
        assert_eq!(
            audit.doubled,
            [DoubledDelivery {
                incident_id: 2,
                keys: vec!["k2".to_owned(), "k3".to_owned()],
            }]
        );
        assert!(audit.missing.is_empty() && audit.strays.is_empty());
        assert!(!audit.holds());
        assert_eq!((audit.incidents, audit.accepted), (2, 3));
    }

    #[test]
    fn an_incident_never_accepted_is_missing_unless_its_job_is_still_pending() {
        let accepted = [delivery("k1", 1)];
        let audit = DeliveryAudit::of(&[1, 2, 3], &BTreeSet::from([3]), &accepted);
        assert_eq!(audit.missing, [2]);
        assert_eq!(audit.pending_at_deadline, [3]);
        assert!(!audit.holds());
        let waiting = DeliveryAudit::of(&[1, 3], &BTreeSet::from([3]), &accepted);
        assert!(waiting.holds(), "{waiting:#?}");
    }

    #[test]
    fn a_notification_for_no_incident_of_the_run_is_a_stray() {
        let unreadable = AcceptedDelivery {
            key: "k9".to_owned(),
            body: "not json".to_owned(),
        };
        let accepted = [delivery("k1", 1), delivery("k7", 7), unreadable.clone()];
        let audit = DeliveryAudit::of(&[1], &BTreeSet::new(), &accepted);
        assert_eq!(audit.strays, [delivery("k7", 7), unreadable]);
        assert!(!audit.holds());
        assert!(DeliveryAudit::of(&[1], &BTreeSet::new(), &accepted[..1]).holds());
    }
}
