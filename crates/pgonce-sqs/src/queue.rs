//! [`SqsQueue`]: the [`Queue`] trait on one SQS queue.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, UNIX_EPOCH};

use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry, Message,
    MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use futures::FutureExt;
use pgonce::queue::MAX_BATCH;
use pgonce::{
    Error, Queue, QueueAttributes, QueueStats, Receipt, ReceiveRequest, Received, Result,
    SendMessage, Sent,
};

use crate::SqsConfig;
use crate::error::{BACKEND, from_code, map, map_on, stale};
use crate::retry;

/// The message attribute that carries a message's pgonce id across a
/// redrive (SQS gives the re-sent copy a new MessageId).
const ID_ATTRIBUTE: &str = "pgonce.id";

/// SQS's cap on message attributes per message (one is `ID_ATTRIBUTE`
/// after a redrive, so a send takes one fewer).
const SQS_MAX_ATTRIBUTES: usize = 10;

/// SQS's per-request cap on messages (send, receive, delete batches).
const SQS_BATCH: usize = 10;

/// SQS's limit on one message, and on the messages of one SendMessageBatch
/// request together: 256 KiB. A queue's `MaximumMessageSize` may be lower.
const SQS_MAX_MESSAGE_BYTES: usize = 262_144;

/// What the `pgonce.id` attribute a redrive adds counts toward a message's
/// size: its name, its data type (`String`) and an SQS message id (a UUID,
/// 36 characters).
const ID_ATTRIBUTE_BYTES: usize = ID_ATTRIBUTE.len() + "String".len() + 36;

/// SQS's longest long-polling wait per request.
const SQS_MAX_WAIT: Duration = Duration::from_secs(20);

/// SQS's fixed deduplication window (FIFO queues).
pub const SQS_DEDUP_WINDOW: Duration = Duration::from_secs(5 * 60);

/// A connection to SQS (one SDK client, shared by the queues it opens).
#[derive(Clone, Debug)]
pub struct SqsClient {
    client: aws_sdk_sqs::Client,
    config: SqsConfig,
}

impl SqsClient {
    /// Loads the AWS configuration with `config`'s overrides. Reaches no
    /// server yet.
    pub async fn connect(config: SqsConfig) -> Result<SqsClient> {
        let client = config.load().await?;
        Ok(SqsClient { client, config })
    }

    /// The SDK client, for what pgonce does not wrap.
    pub fn sdk(&self) -> &aws_sdk_sqs::Client {
        &self.client
    }

    /// Creates the queue (or opens it when it exists with the same
    /// attributes; SQS refuses different ones) and opens it.
    ///
    /// `attributes` as for the PostgreSQL queue, within SQS's limits: FIFO
    /// names end in `.fifo`; retention 60 s to 14 days; the deduplication
    /// window is SQS's fixed 5 minutes; content-based deduplication only on
    /// FIFO queues. The dead-letter queue must exist.
    pub async fn create_queue(&self, name: &str, attributes: QueueAttributes) -> Result<SqsQueue> {
        validate(name, &attributes)?;
        let mut attrs = sqs_attributes(&attributes);
        if let (Some(dlq), Some(max)) =
            (&attributes.dead_letter_queue, attributes.max_receive_count)
        {
            let dlq_url = self.queue_url(dlq).await?;
            let arn = self
                .attribute(&dlq_url, QueueAttributeName::QueueArn)
                .await?
                .ok_or_else(|| backend_error("no QueueArn for the dead-letter queue"))?;
            attrs.insert(
                QueueAttributeName::RedrivePolicy,
                format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"{max}"}}"#),
            );
        }
        self.client
            .create_queue()
            .queue_name(name)
            .set_attributes(Some(attrs))
            .send()
            .await
            .map_err(|e| map(e, None))?;
        self.open(name).await
    }

    /// Opens an existing queue: [`Error::QueueNotFound`] when there is none.
    pub async fn open(&self, name: &str) -> Result<SqsQueue> {
        let url = self.queue_url(name).await?;
        let policy = self
            .attribute(&url, QueueAttributeName::RedrivePolicy)
            .await?;
        let dead_letter_url = match policy.as_deref().and_then(dead_letter_name) {
            Some(dlq) => Some(self.queue_url(&dlq).await?),
            None => None,
        };
        let fifo = name.ends_with(".fifo");
        let content_based_dedup = fifo
            && self
                .attribute(&url, QueueAttributeName::ContentBasedDeduplication)
                .await?
                .is_some_and(|on| on == "true");
        // What a receive that asks for no visibility of its own asks SQS
        // for and states (`Received::visibility`), and how long a FIFO
        // receive may top its batch up (`top_up_fifo`); SQS's default is
        // 30 s.
        let visibility = self
            .attribute(&url, QueueAttributeName::VisibilityTimeout)
            .await?;
        let visibility = Duration::from_secs(visibility.and_then(|s| s.parse().ok()).unwrap_or(30));
        let max_bytes = self.max_message_bytes(&url).await?;
        Ok(SqsQueue {
            inner: Arc::new(Inner {
                client: self.clone(),
                name: name.to_string(),
                url,
                fifo,
                content_based_dedup,
                visibility,
                max_bytes,
                dead_letter_url,
                receiving: AtomicUsize::new(0),
                receive_requests: AtomicU64::new(0),
            }),
        })
    }

    /// The most bytes SQS takes of one message in the queue at `url`: its
    /// `MaximumMessageSize`, at most [`SQS_MAX_MESSAGE_BYTES`] (SQS now
    /// allows larger messages, but pgonce's limit is 256 KiB).
    async fn max_message_bytes(&self, url: &str) -> Result<usize> {
        let max = self
            .attribute(url, QueueAttributeName::MaximumMessageSize)
            .await?;
        Ok(max
            .and_then(|m| m.parse().ok())
            .map_or(SQS_MAX_MESSAGE_BYTES, |m: usize| {
                m.min(SQS_MAX_MESSAGE_BYTES)
            }))
    }

    async fn queue_url(&self, name: &str) -> Result<String> {
        let out = self
            .client
            .get_queue_url()
            .queue_name(name)
            .send()
            .await
            .map_err(|e| match map(e, None) {
                Error::QueueNotFound { .. } => Error::QueueNotFound { name: name.into() },
                other => other,
            })?;
        out.queue_url()
            .map(str::to_string)
            .ok_or_else(|| backend_error("GetQueueUrl returned no URL"))
    }

    async fn attribute(&self, url: &str, name: QueueAttributeName) -> Result<Option<String>> {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(name.clone())
            .send()
            .await
            .map_err(|e| map_on(e, url, None))?;
        Ok(out.attributes().and_then(|a| a.get(&name)).cloned())
    }
}

/// One SQS queue. Cheap to clone (the clones share one client).
///
/// Differences from the contract in `pgonce::queue`, because SQS cannot do
/// otherwise (the tests state each):
///
/// * **Receipts are fenced by queue, not by delivery.** A receipt reads
///   `<queue>:<handle>`, the handle SQS issued for the delivery; one that
///   another queue issued (the source queue's, given to its dead-letter
///   queue's handle, say), or that is not of this form, is
///   [`Error::StaleReceipt`] before any request. That includes a bare SQS
///   handle, as this crate issued receipts before they named their queue:
///   its message is not deleted and comes back after its visibility timeout.
///   Within its queue, a handle goes to SQS as it is, and SQS accepts an
///   earlier delivery's handle ("the request succeeds, but the message
///   might not be deleted"), and so does moto: a handle from before a
///   redelivery, or from before a redrive, may still delete or hide the
///   message. [`Error::StaleReceipt`] is returned then only when the
///   server refuses a handle (as SQS does a visibility change of a message
///   no longer in flight; moto also refuses a handle whose message was
///   purged or moved to the dead-letter queue, where SQS may answer that
///   the delete succeeded). The PostgreSQL queue refuses every receipt but
///   the current delivery's in its own queue. Handlers must be idempotent
///   anyway (at least once); pgonce's database safeguards, not the queue,
///   keep invariants true. Queues of one name in two regions or accounts
///   are one queue to this check; SQS refuses the other's handle.
/// * **Deduplication** exists on FIFO queues only (a standard queue rejects
///   a `dedup_id` with [`Error::Invalid`]), with SQS's fixed 5-minute window.
///   Content-based deduplication is read when the handle is opened.
///   SQS does not say whether a send was a duplicate: [`Sent::duplicate`] is
///   always false and `id` is what SQS returned.
/// * **FIFO receives** return at most one message per group, as the
///   PostgreSQL queue does. They ask SQS for one message per request and
///   top the batch up with further requests that do not wait: asked for
///   more, SQS returns several messages of one group and counts each
///   toward `max_receive_count`, and the ones pgonce could not hand out
///   would be dead-lettered after enough such receives, unseen. A FIFO
///   batch of n messages therefore costs n + 1 requests. The top-up stops
///   after a quarter of the visibility timeout (given, or the handle's, see
///   Visibility), so a slow server hands out a smaller batch
///   rather than messages whose visibility ran out while it filled; with a
///   visibility of zero a FIFO receive returns one message.
/// * **Messages** are refused with [`Error::Invalid`] before any request
///   where SQS would refuse them or store them altered: bodies and
///   attribute values of XML characters only (no control characters but
///   tab, CR and LF), group and deduplication ids of printable ASCII,
///   attribute names as SQS takes them, and at most 9 attributes (SQS
///   takes 10; a redrive adds the `pgonce.id` attribute). A message over
///   SQS's size limit is refused with [`Error::MessageTooLarge`]: SQS counts
///   the body and each attribute's name, data type and value, against
///   256 KiB or the queue's lower `MaximumMessageSize` (read when the
///   handle is opened), and pgonce keeps 51 bytes of that for the
///   `pgonce.id` attribute a redrive adds.
/// * **Attributes** of SQS's other types, sent by a producer outside
///   pgonce (pgonce sends String ones), are read into the string map: a
///   Number's value as sent, a Binary's bytes as their standard base64
///   (RFC 4648, padded), which decodes to them unchanged. The data type is
///   not carried: a consumer knows from its producer which attribute is a
///   Binary (a String may hold the same text).
/// * **Groups on standard queues**: SQS's fair queues let a producer give a
///   standard queue's message a group (pgonce's `send` takes none there, as
///   the trait's contract says). [`Received::group_id`] reports it; it
///   orders nothing and limits nothing in flight (a receive hands out
///   several messages of one group), and a redrive keeps it.
/// * **Batches** (`send_batch`) go out in requests of at most 10 messages
///   and at most SQS's size limit together (each message counted as SQS
///   counts it, and, as a margin for what SQS counts without documenting
///   it, its entry, group and deduplication ids); a request of one message
///   is a SendMessage. They are not
///   atomic: what earlier requests sent stays sent, and so do the entries
///   SQS took of a request that it refused in part (throttled or refused
///   by KMS, for instance). A request that fails, or that SQS takes in
///   part, ends the call with [`Error::SendBatchIncomplete`], naming the
///   messages sent (with their ids) and those not known to be sent: the
///   failed request's refused or unanswered ones, and those of the
///   requests after it, not sent, so that a FIFO group's later messages
///   never go ahead of one to be sent again. Sending those again sends no
///   duplicate, but of a request that failed after SQS took it (see
///   Retries); sending the whole batch again would send duplicates on a
///   standard queue.
///   `delete_batch` goes out in requests of 10 distinct handles (a receipt
///   given twice goes once, as SQS refuses a request naming a handle
///   twice); a request that fails ends the call with
///   [`Error::DeleteBatchIncomplete`], which names the receipts still to
///   delete, as what the requests before it deleted stays deleted.
/// * **Retries** of a send (SendMessage, SendMessageBatch, a redrive's
///   re-send) by the SDK (up to [`SqsConfig::max_attempts`]) are blind to
///   whether SQS took the failed attempt. On a FIFO queue that is
///   harmless: every message goes with a deduplication id (the caller's, a
///   fresh one per call, or the body's with content-based deduplication),
///   the same on each attempt, and SQS drops a second copy within its
///   5-minute window. A standard queue takes it as a second message, so
///   there the SDK retries only what SQS did not take: a request it
///   refused with a client error (throttled), or whose connection was
///   never made. An attempt it may have taken (the connection dropped
///   after the request went out, an answer not read, a server error) ends
///   the call: [`Error::Unavailable`] (a batch: [`Error::SendBatchIncomplete`]
///   with that cause, the request's messages unsent), or [`Error::Backend`]
///   for a server error, and the messages may or may not be in the queue;
///   sending them again is at least once. So is an operation timeout,
///   which ends every attempt and is never retried.
/// * **Visibility** of one delivery ends at most 12 hours after its
///   receive: SQS refuses a `change_visibility` that would reach past that
///   ([`Error::Backend`], `InvalidParameterValue`, not `StaleReceipt`).
///   A worker's heartbeats then fail (logged), and a handler still running
///   sees its message delivered again; the PostgreSQL queue extends a
///   delivery without limit. SQS states no end per delivery:
///   [`Received::visibility`] is the receive's visibility, or else the
///   handle's: the queue's `VisibilityTimeout` as read when the handle was
///   opened. Every ReceiveMessage request carries that visibility, so SQS
///   hides each delivery for what it states, whatever the queue's attribute
///   says by then: a change to the attribute reaches the handles opened
///   after it, not those already open (open the queue again to take it
///   up). (Left to the queue's attribute, a handle opened before a change
///   stated the old timeout: a worker counting from a longer one beat
///   after its delivery ran out, extending another consumer's.) It is
///   counted from [`Received::requested_at`], when the attempt of the
///   ReceiveMessage request that returned the message went out (after
///   the SDK's retries of earlier attempts, refused or unanswered, and
///   their backoff: a message an unanswered attempt delivered stays
///   hidden for its own visibility and comes back then). SQS may have
///   delivered it up to that request's long poll wait (20 s at most)
///   later, and says not when: a delivery made late in a long poll looks
///   run out that much before it does (a worker's heartbeat stops early),
///   a slack that cannot be taken out here.
/// * **Long polls** wait 20 s per ReceiveMessage request at most: a
///   receive with a longer wait is a series of requests. Told to stop
///   ([`Queue::receive_or_stop`]), it finishes the request under way and
///   sends no other: it cannot tell a request waiting from one delivering,
///   so it returns up to 20 s after the stop, with what that request
///   delivered.
/// * **Stats** have no `oldest_age` (SQS reports it to CloudWatch only).
/// * **Redrive** (called on a dead-letter queue) re-sends each visible
///   message to the one source queue and deletes it from the dead-letter
///   queue, one message at a time; the message keeps its attributes (of
///   any SQS type), its group and its pgonce id (carried in the
///   `pgonce.id` attribute) and starts with a fresh receive count. A
///   message sent by another producer with SQS's 10 attributes, or too
///   large to take the attribute, moves under a new id. Each message is
///   hidden in the dead-letter queue until its delete (see
///   `redrive_receive`): as long as every call ends within the operation
///   timeout, which the SDK enforces, two redrives running at once never
///   move one message twice. A redrive that fails between a re-send and
///   its delete (the delete failed, or timed out, or a re-send timed out
///   after SQS took it) leaves the message in both queues; it is visible
///   again in the dead-letter queue three operation timeouts and a second
///   after its receive. Run again, the redrive sends it a second time to a
///   standard queue (at least once); to a FIFO queue within SQS's 5-minute
///   deduplication window of the first re-send it does not, as each
///   re-send's deduplication id is the dead-letter message's id.
#[derive(Clone, Debug)]
pub struct SqsQueue {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: SqsClient,
    name: String,
    url: String,
    fifo: bool,
    /// The FIFO queue derives a deduplication id from each body (read when
    /// the handle is opened).
    content_based_dedup: bool,
    /// The queue's visibility timeout (read when the handle is opened):
    /// what a receive asks SQS for, and states for its deliveries, unless
    /// it asks for another (`Received::visibility`); see `top_up_fifo`
    /// too. A change made to the queue after that is not seen, and not
    /// applied either: every receive sends this (see [`SqsQueue`],
    /// Visibility).
    visibility: Duration,
    /// The most bytes SQS takes of one message (body and attributes) in
    /// this queue, and of one batch request's messages together (read when
    /// the handle is opened).
    max_bytes: usize,
    dead_letter_url: Option<String>,
    /// Receive calls under way (the tests' "parked" signal).
    receiving: AtomicUsize,
    /// ReceiveMessage requests begun.
    receive_requests: AtomicU64,
}

impl SqsQueue {
    /// The queue URL.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// How many receive calls of this queue's handles are under way.
    pub fn receives_in_flight(&self) -> usize {
        self.inner.receiving.load(Ordering::SeqCst)
    }

    /// How many ReceiveMessage requests this handle and its clones have begun:
    /// a receive's long polls (20 s each at most), a FIFO receive's
    /// top-ups, a redrive's receives from this (dead-letter) queue. SQS
    /// bills by the request; the tests count a receive's polls with it.
    pub fn receive_requests(&self) -> u64 {
        self.inner.receive_requests.load(Ordering::SeqCst)
    }

    fn sdk(&self) -> &aws_sdk_sqs::Client {
        &self.inner.client.client
    }

    fn config(&self) -> &SqsConfig {
        &self.inner.client.config
    }

    /// The visibility a receive asking for `asked` gives its deliveries,
    /// in the whole seconds `receive_raw` sends: `asked`, or the queue's
    /// timeout as read when the handle was opened.
    fn visibility(&self, asked: Option<Duration>) -> Duration {
        Duration::from_secs(ceil_secs(asked.unwrap_or(self.inner.visibility)))
    }

    /// The SQS handle `receipt` wraps, when this queue issued it; else the
    /// receipt is refused here, [`Error::StaleReceipt`], and SQS is not
    /// asked: handed another queue's handle, SQS (and moto) may act on
    /// the message under it (see [`ReceiptParts`]).
    fn handle<'r>(&self, receipt: &'r Receipt) -> Result<&'r str> {
        match ReceiptParts::parse(&receipt.0) {
            Some(parts) if parts.queue == self.inner.name => Ok(parts.handle),
            Some(_) => Err(stale(&receipt.0, "issued by another queue")),
            None => Err(stale(&receipt.0, "not a receipt of pgonce-sqs")),
        }
    }

    /// Validates for SQS; fills in what SQS requires.
    fn prepare<'m>(&self, message: &'m SendMessage) -> Result<Outgoing<'m>> {
        message.validate(self.inner.fifo)?;
        let invalid = |why: &str| Error::Invalid {
            what: "message",
            why: why.into(),
        };
        if !self.inner.fifo && message.dedup_id.is_some() {
            return Err(invalid(
                "SQS standard queues do not deduplicate; use a FIFO queue for a dedup id",
            ));
        }
        if self.inner.fifo && message.delay.is_some_and(|d| !d.is_zero()) {
            return Err(invalid("SQS FIFO queues take no per-message delay"));
        }
        // SQS refuses these (or, for a body, may store it with the
        // characters replaced): refused here, a batch sends none of them
        // rather than the requests before the one SQS refuses.
        if !sqs_text(&message.body) {
            return Err(invalid(
                "SQS takes only XML characters: tab, CR, LF and U+0020 up (no other control characters, no U+FFFE or U+FFFF)",
            ));
        }
        let ascii_id = |id: &Option<String>| {
            id.as_deref()
                .is_none_or(|i| i.chars().all(|c| c.is_ascii_graphic()))
        };
        if !ascii_id(&message.group_id) || !ascii_id(&message.dedup_id) {
            return Err(invalid(
                "SQS group and deduplication ids are ASCII letters, digits and punctuation",
            ));
        }
        if message.attributes.len() >= SQS_MAX_ATTRIBUTES {
            return Err(invalid(
                "SQS takes 10 attributes per message, one of them the pgonce id a redrive carries: at most 9",
            ));
        }
        for (name, value) in &message.attributes {
            if name.starts_with("pgonce.") {
                return Err(invalid(
                    "attribute names starting with pgonce. are reserved",
                ));
            }
            if !sqs_attribute_name(name) {
                return Err(invalid(
                    "SQS attribute names are 1 to 256 of A-Z a-z 0-9 _ - ., with no period first, last or twice in a row, and not starting with AWS. or Amazon.",
                ));
            }
            if value.is_empty() {
                return Err(invalid("SQS attribute values must not be empty"));
            }
            if !sqs_text(value) {
                return Err(invalid(
                    "SQS attribute values take the body's characters only",
                ));
            }
        }
        // SQS counts the attributes toward its size limit, not the body
        // alone, and refuses a message over it. Room is kept for the
        // pgonce id a redrive adds, as one of the 10 attributes is: a
        // message that fits only without it could be sent, but not
        // redriven under its id.
        let attributes = Self::attributes(message);
        let bytes = sqs_size(&message.body, &attributes);
        let max = self.inner.max_bytes.saturating_sub(ID_ATTRIBUTE_BYTES);
        if bytes > max {
            return Err(Error::MessageTooLarge { size: bytes, max });
        }
        Ok(Outgoing {
            message,
            attributes,
            dedup_id: self.dedup_id(message),
            bytes,
        })
    }

    /// One SendMessage request.
    async fn send_one(&self, outgoing: &Outgoing<'_>) -> Result<Sent> {
        let message = outgoing.message;
        let mut call = self
            .sdk()
            .send_message()
            .queue_url(&self.inner.url)
            .message_body(&message.body)
            .set_message_attributes(Some(outgoing.attributes.clone()))
            .set_message_group_id(message.group_id.clone())
            .set_message_deduplication_id(outgoing.dedup_id.clone())
            .set_delay_seconds(message.delay.map(|d| ceil_secs(d) as i32))
            .customize();
        if let Some(config) = retry::for_sends(self.inner.fifo) {
            call = call.config_override(config);
        }
        let out = call
            .send()
            .await
            .map_err(|e| map_on(e, &self.inner.url, None))?;
        Ok(Sent {
            id: out.message_id().unwrap_or_default().to_string(),
            duplicate: false,
        })
    }

    fn attributes(message: &SendMessage) -> HashMap<String, MessageAttributeValue> {
        message
            .attributes
            .iter()
            .map(|(k, v)| (k.clone(), string_attribute(v)))
            .collect()
    }

    /// FIFO messages need a deduplication id unless the queue derives one
    /// from the body (content-based deduplication: SQS does, given none);
    /// otherwise a message without one gets a fresh one (no deduplication).
    fn dedup_id(&self, message: &SendMessage) -> Option<String> {
        match (&message.dedup_id, self.inner.fifo) {
            (Some(d), true) => Some(d.clone()),
            (None, true) if self.inner.content_based_dedup => None,
            (None, true) => Some(fresh_id()),
            _ => None,
        }
    }

    async fn receive_once(
        &self,
        max: usize,
        wait: Duration,
        visibility: Option<Duration>,
    ) -> Result<Vec<Received>> {
        let (requested_at, messages) = self.receive_raw(max, wait, visibility).await?;
        let mut got = Vec::new();
        let mut groups = HashSet::new();
        let mut release = Vec::new();
        let visibility = self.visibility(visibility);
        for m in &messages {
            let received = to_received(m, &self.inner.name, visibility, requested_at)?;
            if self.inner.fifo
                && let Some(g) = &received.group_id
                && !groups.insert(g.clone())
            {
                release.push(received.receipt);
                continue;
            }
            got.push(received);
        }
        // A failed release does not fail the receive: what it delivered is
        // handed out (failing, it would wait out its visibility timeout
        // unseen); the messages not released come back after theirs, their
        // group held until then, its order kept.
        if !release.is_empty()
            && let Err(e) = self.release(&release).await
        {
            tracing::warn!(queue = %self.inner.name, error = %e, held = release.len(),
                "could not make a FIFO group's later messages visible again; they return after their visibility timeout");
        }
        metrics::counter!("pgonce_sqs_received_total", "queue" => self.inner.name.clone())
            .increment(got.len() as u64);
        Ok(got)
    }

    /// One ReceiveMessage request: when the attempt of it that answered
    /// went out (`Received::requested_at` of its deliveries), and its
    /// messages as SQS returned them. `wait` is
    /// at most SQS's 20 s (a longer wait is several requests).
    async fn receive_raw(
        &self,
        max: usize,
        wait: Duration,
        visibility: Option<Duration>,
    ) -> Result<(Instant, Vec<Message>)> {
        debug_assert!(wait <= SQS_MAX_WAIT, "{wait:?}");
        // The visibility always goes with the request, the queue's as read
        // when the handle was opened included: SQS applies what it is
        // given, so the deliveries last what they state
        // (`Received::visibility`), whatever the queue's attribute was
        // changed to since.
        let call = self
            .sdk()
            .receive_message()
            .queue_url(&self.inner.url)
            .max_number_of_messages(max.min(SQS_BATCH) as i32)
            .wait_time_seconds(ceil_secs(wait) as i32)
            .visibility_timeout(self.visibility(visibility).as_secs() as i32)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All");
        self.inner.receive_requests.fetch_add(1, Ordering::SeqCst);
        metrics::counter!("pgonce_sqs_receive_requests_total", "queue" => self.inner.name.clone())
            .increment(1);
        // When the attempt that answered went out: SQS counts a delivery's
        // visibility from some time within that attempt, not known here (it
        // may have waited up to `wait` first), so counted from there the
        // stated end is never past the real one. Not from the start of the
        // call: the SDK may have sent and retried attempts before (refused,
        // or their answer lost), and counted from the first, a delivery
        // looked run out those attempts and their backoff early.
        let attempts = retry::AttemptClock::default();
        let called_at = Instant::now();
        let out = call
            .customize()
            .config_override(
                aws_sdk_sqs::config::Builder::default()
                    .timeout_config(self.config().timeouts(wait)),
            )
            .interceptor(attempts.clone())
            .send()
            .await
            .map_err(|e| map_on(e, &self.inner.url, None))?;
        let requested_at = attempts.last_sent().unwrap_or(called_at);
        Ok((requested_at, out.messages.unwrap_or_default()))
    }

    /// Tops a FIFO batch up to the request's size, one message per SQS
    /// request, without waiting.
    ///
    /// SQS returns as many messages of one group as a request asks for, and
    /// counts each toward the dead-letter queue's `max_receive_count`. pgonce
    /// hands out one message per group in flight, so the rest of the group
    /// would have to be made visible again, and SQS would count each of
    /// those receives: a message deep in its group's backlog reached the
    /// dead-letter queue before any consumer saw it. Asked for one message,
    /// SQS returns a group's head and keeps the group locked while the head
    /// is in flight, so each further request returns another group's head
    /// and every message SQS counts as received is handed out. The price is
    /// a request per message, and one more that finds none.
    ///
    /// A top-up request that fails ends the batch: the messages already
    /// received are handed out rather than left to their visibility timeout.
    ///
    /// The top-up stops once it has taken a quarter of the visibility
    /// timeout (its own, or the queue's), so every message of the batch is
    /// handed out with at least three quarters of it left. Requests answered
    /// slowly (a loaded server) would otherwise hand out messages whose
    /// visibility had run out while the batch filled, delivered again to
    /// another consumer meanwhile, and each such delivery counts toward
    /// `max_receive_count`. So a receive with a visibility of zero is not
    /// topped up at all: its message is visible again at once, its group
    /// unlocked, and the next request would return the same head again.
    ///
    /// A receive told to stop (`stop`) is not topped up further: the
    /// messages it has are returned, and no more are taken for a consumer
    /// that is stopping.
    async fn top_up_fifo<F: Future<Output = ()>>(
        &self,
        mut got: Vec<Received>,
        request: &ReceiveRequest,
        stop: &mut Stop<F>,
    ) -> Vec<Received> {
        let started = Instant::now();
        let visibility = self.visibility(request.visibility);
        let mut groups: HashSet<String> = got.iter().filter_map(|m| m.group_id.clone()).collect();
        while got.len() < request.max_messages
            && started.elapsed() < visibility / 4
            && !stop.raised()
        {
            let more = match self
                .receive_once(1, Duration::ZERO, request.visibility)
                .await
            {
                Ok(more) => more,
                Err(e) => {
                    tracing::warn!(queue = %self.inner.name, error = %e,
                        "topping up a FIFO receive failed; handing out what it has");
                    break;
                }
            };
            let Some(message) = more.into_iter().next() else {
                break;
            };
            if let Some(group) = &message.group_id
                && !groups.insert(group.clone())
            {
                // A head whose visibility ran out during the top-up is
                // visible again, its group unlocked: not handed out twice.
                if let Err(e) = self.release(std::slice::from_ref(&message.receipt)).await {
                    tracing::warn!(queue = %self.inner.name, error = %e,
                        "releasing a FIFO head received twice failed");
                }
                break;
            }
            got.push(message);
        }
        got
    }

    /// One request of a `send_batch`: `chunk`'s messages, a SendMessage for
    /// one alone (its limit is the one message's `prepare` checked, margin
    /// or no margin), else a SendMessageBatch. Fills the place in `places`
    /// of each message that went through; the request's error when it
    /// failed, or the first refused message's when SQS took it in part,
    /// and `Ok` only when every place is filled.
    async fn send_request(
        &self,
        chunk: &[Outgoing<'_>],
        places: &mut [Option<Sent>],
    ) -> Result<()> {
        if let ([one], [place]) = (chunk, &mut *places) {
            *place = Some(self.send_one(one).await?);
            return Ok(());
        }
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, o)| {
                let m = o.message;
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(&m.body)
                    .set_message_attributes(Some(o.attributes.clone()))
                    .set_message_group_id(m.group_id.clone())
                    .set_message_deduplication_id(o.dedup_id.clone())
                    .set_delay_seconds(m.delay.map(|d| ceil_secs(d) as i32))
                    .build()
                    .map_err(|e| backend_error(&e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut call = self
            .sdk()
            .send_message_batch()
            .queue_url(&self.inner.url)
            .set_entries(Some(entries))
            .customize();
        if let Some(config) = retry::for_sends(self.inner.fifo) {
            call = call.config_override(config);
        }
        let out = call
            .send()
            .await
            .map_err(|e| map_on(e, &self.inner.url, None))?;
        let n = places.len();
        let place = |id: &str| entry_place(id, n);
        for done in out.successful() {
            if let Some(i) = place(done.id()) {
                places[i] = Some(Sent {
                    id: done.message_id().to_string(),
                    duplicate: false,
                });
            }
        }
        // In input order, the first message not sent says why.
        let refused: HashMap<usize, &_> = out
            .failed()
            .iter()
            .filter_map(|f| Some((place(f.id())?, f)))
            .collect();
        match (0..n).find(|&i| places[i].is_none()) {
            None => Ok(()),
            Some(i) => Err(match refused.get(&i) {
                Some(f) => from_code(f.code(), f.message().unwrap_or_default(), None),
                None => backend_error("SendMessageBatch left an entry unanswered"),
            }),
        }
    }

    /// Makes these deliveries (of this queue) visible again at once; the
    /// first refused one's error, [`Error::StaleReceipt`] when SQS refused
    /// its receipt.
    async fn release(&self, receipts: &[Receipt]) -> Result<()> {
        let entries = receipts
            .iter()
            .enumerate()
            .map(|(i, r)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(self.handle(r)?)
                    .visibility_timeout(0)
                    .build()
                    .map_err(|e| backend_error(&e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        let out = self
            .sdk()
            .change_message_visibility_batch()
            .queue_url(&self.inner.url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| map_on(e, &self.inner.url, None))?;
        // An entry refused for its receipt is a stale receipt, as in every
        // other call: the entry's id is its receipt's place.
        match out.failed().first() {
            Some(f) => {
                let receipt = entry_place(f.id(), receipts.len()).map(|i| receipts[i].0.as_str());
                Err(from_code(
                    f.code(),
                    f.message().unwrap_or_default(),
                    receipt,
                ))
            }
            None => Ok(()),
        }
    }

    /// One DeleteMessageBatch request of up to 10 distinct handles: records
    /// what became of each in `entries`; the request's error when it
    /// failed, every entry left undone. An entry SQS refused for another
    /// reason than staleness, or left unanswered, is left undone with the
    /// reason.
    async fn delete_request(&self, entries: &mut [DeleteEntry<'_>]) -> Result<()> {
        let request = entries
            .iter()
            .enumerate()
            .map(|(i, entry)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(entry.handle)
                    .build()
                    .map_err(|e| backend_error(&e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        let out = self
            .sdk()
            .delete_message_batch()
            .queue_url(&self.inner.url)
            .set_entries(Some(request))
            .send()
            .await
            .map_err(|e| map_on(e, &self.inner.url, None))?;
        let n = entries.len();
        let place = |id: &str| entry_place(id, n);
        for done in out.successful() {
            if let Some(i) = place(done.id()) {
                entries[i].outcome = DeleteOutcome::Deleted;
            }
        }
        for f in out.failed() {
            let Some(i) = place(f.id()) else { continue };
            let receipt = &entries[i].receipt.0;
            match from_code(f.code(), f.message().unwrap_or_default(), Some(receipt)) {
                Error::StaleReceipt { .. } => entries[i].outcome = DeleteOutcome::Stale,
                other => entries[i].refused = Some(other),
            }
        }
        for entry in entries
            .iter_mut()
            .filter(|e| e.outcome == DeleteOutcome::Undone && e.refused.is_none())
        {
            entry.refused = Some(backend_error("DeleteMessageBatch left an entry unanswered"));
        }
        Ok(())
    }

    async fn counts(&self, url: &str) -> Result<MessageCounts> {
        let out = self
            .sdk()
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            .send()
            .await
            .map_err(|e| map_on(e, url, None))?;
        let get = |name: QueueAttributeName| -> u64 {
            out.attributes()
                .and_then(|a| a.get(&name))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Ok(MessageCounts {
            visible: get(QueueAttributeName::ApproximateNumberOfMessages),
            in_flight: get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
            delayed: get(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
        })
    }
}

/// A queue's approximate message counts, as `GetQueueAttributes` gives them.
struct MessageCounts {
    /// Ready to be received.
    visible: u64,
    /// Received and not yet deleted, within their visibility timeout.
    in_flight: u64,
    /// Sent with a delay that has not run out.
    delayed: u64,
}

impl MessageCounts {
    fn total(&self) -> u64 {
        self.visible + self.in_flight + self.delayed
    }
}

impl Queue for SqsQueue {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn is_fifo(&self) -> bool {
        self.inner.fifo
    }

    async fn send(&self, message: SendMessage) -> Result<Sent> {
        let sent = self.send_one(&self.prepare(&message)?).await?;
        metrics::counter!("pgonce_sqs_sent_total", "queue" => self.inner.name.clone()).increment(1);
        Ok(sent)
    }

    async fn send_batch(&self, messages: Vec<SendMessage>) -> Result<Vec<Sent>> {
        if messages.is_empty() || messages.len() > MAX_BATCH {
            return Err(Error::Invalid {
                what: "batch",
                why: format!("a batch holds 1 to {MAX_BATCH} messages"),
            });
        }
        let outgoing = messages
            .iter()
            .map(|m| self.prepare(m))
            .collect::<Result<Vec<_>>>()?;
        let bytes: Vec<usize> = outgoing.iter().map(Outgoing::batch_bytes).collect();
        let mut sent: Vec<Option<Sent>> = vec![None; messages.len()];
        let mut cause = None;
        for request in batch_requests(&bytes, self.inner.max_bytes) {
            let (chunk, places) = (&outgoing[request.clone()], &mut sent[request]);
            if let Err(e) = self.send_request(chunk, places).await {
                cause = Some(e);
                break;
            }
        }
        metrics::counter!("pgonce_sqs_sent_total", "queue" => self.inner.name.clone())
            .increment(sent.iter().flatten().count() as u64);
        match cause {
            // Every request went through whole: every place is filled.
            None => Ok(sent.into_iter().flatten().collect()),
            Some(cause) => Err(Error::SendBatchIncomplete {
                unsent: (0..sent.len()).filter(|&i| sent[i].is_none()).collect(),
                sent,
                cause: Box::new(cause),
            }),
        }
    }

    async fn receive(&self, request: ReceiveRequest) -> Result<Vec<Received>> {
        self.receive_or_stop(request, std::future::pending()).await
    }

    /// A receive is a series of ReceiveMessage requests, each waiting 20 s
    /// at most (SQS's longest long poll), until one delivers or the wait is
    /// over. `stop` is looked at between requests, never during one: a
    /// request under way may be delivering, and dropped, what it delivered
    /// would reach nobody and wait out its visibility timeout. So once
    /// `stop` resolves, the request under way finishes and its messages are
    /// returned, and no further request is sent: a long poll that came
    /// back empty is not followed by another, and a FIFO batch is not
    /// topped up further. A receive whose `stop` resolved before it began
    /// sends no request and returns none (as the trait says: a delivery
    /// made only to be handed back would count toward the message's
    /// `max_receive_count`).
    async fn receive_or_stop(
        &self,
        request: ReceiveRequest,
        stop: impl Future<Output = ()> + Send,
    ) -> Result<Vec<Received>> {
        request.validate()?;
        self.inner.receiving.fetch_add(1, Ordering::SeqCst);
        let _guard = Receiving(&self.inner.receiving);
        let mut stop = Stop::new(stop);
        if stop.raised() {
            return Ok(Vec::new());
        }
        let deadline = Instant::now() + request.wait;
        // A FIFO receive asks for one message per request: see `top_up_fifo`.
        let per_request = if self.inner.fifo {
            1
        } else {
            request.max_messages
        };
        loop {
            // SQS waits 20 s per request at most: longer waits re-poll.
            let left = deadline.saturating_duration_since(Instant::now());
            let wait = if stop.raised() {
                Duration::ZERO
            } else {
                left.min(SQS_MAX_WAIT)
            };
            let got = self
                .receive_once(per_request, wait, request.visibility)
                .await?;
            if !got.is_empty() && self.inner.fifo {
                return Ok(self.top_up_fifo(got, &request, &mut stop).await);
            }
            if !got.is_empty() || left <= SQS_MAX_WAIT || stop.raised() {
                return Ok(got);
            }
        }
    }

    async fn delete(&self, receipt: &Receipt) -> Result<()> {
        let handle = self.handle(receipt)?;
        self.sdk()
            .delete_message()
            .queue_url(&self.inner.url)
            .receipt_handle(handle)
            .send()
            .await
            .map_err(|e| map_on(e, &self.inner.url, Some(&receipt.0)))?;
        Ok(())
    }

    /// The receipts go in requests of 10, and SQS cannot take back what a
    /// request deleted: a request that fails after others went through
    /// leaves their deletes done. So a failure does not end the call with
    /// that error alone, which would hide them, but with
    /// [`Error::DeleteBatchIncomplete`], naming the receipts stale and
    /// those not known to be deleted: of the failed request (it may have
    /// taken effect) and of the requests after it, not sent (each would
    /// likely fail the same way, an operation timeout each). A receipt
    /// refused for another reason than staleness is not known to be deleted
    /// either; the requests after it still go.
    ///
    /// A receipt given twice goes once: SQS refuses a request that names a
    /// handle twice (`BatchEntryIdsNotDistinct`), whole.
    async fn delete_batch(&self, receipts: &[Receipt]) -> Result<Vec<Receipt>> {
        if receipts.len() > MAX_BATCH {
            return Err(Error::Invalid {
                what: "batch",
                why: format!("a batch holds at most {MAX_BATCH} receipts"),
            });
        }
        // Receipts of another queue are stale without a request. The rest
        // go once per distinct handle, in order of first appearance; each
        // receipt's place in `handles`, or `None` for a foreign one.
        let mut handles: Vec<DeleteEntry> = Vec::new();
        let mut first: HashMap<&str, usize> = HashMap::new();
        let places: Vec<Option<usize>> = receipts
            .iter()
            .map(|r| {
                let handle = self.handle(r).ok()?;
                Some(*first.entry(handle).or_insert_with(|| {
                    handles.push(DeleteEntry {
                        receipt: r,
                        handle,
                        outcome: DeleteOutcome::Undone,
                        refused: None,
                    });
                    handles.len() - 1
                }))
            })
            .collect();
        let mut cause = None;
        for chunk in handles.chunks_mut(SQS_BATCH) {
            if let Err(e) = self.delete_request(chunk).await {
                cause = Some(e);
                break;
            }
        }
        // The first refused entry's error, when no request failed.
        let cause = cause.or_else(|| handles.iter_mut().find_map(|h| h.refused.take()));
        let outcome =
            |place: &Option<usize>| place.map_or(DeleteOutcome::Stale, |p| handles[p].outcome);
        let with = |wanted: DeleteOutcome| -> Vec<Receipt> {
            receipts
                .iter()
                .zip(&places)
                .filter(|(_, place)| outcome(place) == wanted)
                .map(|(r, _)| r.clone())
                .collect()
        };
        match cause {
            None => Ok(with(DeleteOutcome::Stale)),
            Some(cause) => Err(Error::DeleteBatchIncomplete {
                stale: with(DeleteOutcome::Stale),
                undone: with(DeleteOutcome::Undone),
                cause: Box::new(cause),
            }),
        }
    }

    async fn change_visibility(&self, receipt: &Receipt, timeout: Duration) -> Result<()> {
        if timeout > Duration::from_secs(12 * 3600) {
            return Err(Error::Invalid {
                what: "visibility timeout",
                why: "at most 12 hours".into(),
            });
        }
        let handle = self.handle(receipt)?;
        self.sdk()
            .change_message_visibility()
            .queue_url(&self.inner.url)
            .receipt_handle(handle)
            .visibility_timeout(ceil_secs(timeout) as i32)
            .send()
            .await
            .map_err(|e| map_on(e, &self.inner.url, Some(&receipt.0)))?;
        Ok(())
    }

    /// SQS purges asynchronously (up to 60 s) and once per 60 s per queue;
    /// the count is the approximate number of messages before the purge.
    ///
    /// A purge within 60 s of the last one is [`Error::PurgeInProgress`],
    /// not success: SQS deletes what was sent before the earlier purge
    /// began, and "might" delete what was sent since, so this call's
    /// promise (every message sent before it gone) would not be kept. The
    /// caller purges again once the earlier purge is over.
    async fn purge(&self) -> Result<u64> {
        let before = self.counts(&self.inner.url).await?;
        self.sdk()
            .purge_queue()
            .queue_url(&self.inner.url)
            .send()
            .await
            .map_err(|e| match map_on(e, &self.inner.url, None) {
                Error::PurgeInProgress { .. } => Error::PurgeInProgress {
                    queue: self.inner.name.clone(),
                },
                other => other,
            })?;
        Ok(before.total())
    }

    async fn stats(&self) -> Result<QueueStats> {
        let counts = self.counts(&self.inner.url).await?;
        let dead_letter_depth = match &self.inner.dead_letter_url {
            Some(url) => Some(self.counts(url).await?.total()),
            None => None,
        };
        Ok(QueueStats {
            depth: counts.visible,
            in_flight: counts.in_flight,
            delayed: counts.delayed,
            oldest_age: None,
            dead_letter_depth,
        })
    }

    async fn redrive(&self) -> Result<u64> {
        let out = self
            .sdk()
            .list_dead_letter_source_queues()
            .queue_url(&self.inner.url)
            .send()
            .await
            .map_err(|e| map_on(e, &self.inner.url, None))?;
        let source = match out.queue_urls() {
            [one] => one.clone(),
            [] => {
                return Err(Error::Invalid {
                    what: "redrive",
                    why: format!("{} is no queue's dead-letter queue", self.inner.name),
                });
            }
            _ => {
                return Err(Error::Invalid {
                    what: "redrive",
                    why: format!(
                        "{} is the dead-letter queue of several queues; SQS does not record which \
                         a message came from",
                        self.inner.name
                    ),
                });
            }
        };
        let source_fifo = source.ends_with(".fifo");
        let source_max = self.inner.client.max_message_bytes(&source).await?;
        let take = redrive_receive(self.config().operation_timeout);
        let mut moved = 0;
        loop {
            // One message at a time, moved before the next is received: a
            // FIFO group's in its order, and each held in the dead-letter
            // queue until it is deleted there (see `redrive_receive`).
            let (requested_at, batch) = self
                .receive_raw(take.max_messages, take.wait, Some(take.visibility))
                .await?;
            if batch.is_empty() {
                return Ok(moved);
            }
            for raw in batch {
                let m = to_received(
                    &raw,
                    &self.inner.name,
                    self.visibility(Some(take.visibility)),
                    requested_at,
                )?;
                // The attributes as sent, of whatever type (a producer
                // outside pgonce may send Number and Binary ones), and the
                // pgonce id where there is room for it.
                let attributes = carry_id(
                    &m.body,
                    raw.message_attributes.clone().unwrap_or_default(),
                    &m.id,
                    source_max,
                );
                // Sent first, deleted second: a failure in between leaves a
                // copy in both queues (at least once), never none. On a
                // FIFO source the copy's deduplication id is the
                // dead-letter message's id, the same on every redrive of
                // it, so a redrive run again within SQS's deduplication
                // window does not send it twice. A standard queue's
                // message keeps the group a producer gave it (SQS's fair
                // queues).
                let dedup_id =
                    source_fifo.then(|| raw.message_id().map_or_else(fresh_id, str::to_string));
                let mut resend = self
                    .sdk()
                    .send_message()
                    .queue_url(&source)
                    .message_body(&m.body)
                    .set_message_attributes(Some(attributes))
                    .set_message_group_id(m.group_id.clone())
                    .set_message_deduplication_id(dedup_id)
                    .customize();
                if let Some(config) = retry::for_sends(source_fifo) {
                    resend = resend.config_override(config);
                }
                resend.send().await.map_err(|e| map_on(e, &source, None))?;
                self.delete(&m.receipt).await?;
                moved += 1;
            }
        }
    }
}

/// One distinct handle of a `delete_batch`: the first receipt that named
/// it, and what became of it.
struct DeleteEntry<'r> {
    receipt: &'r Receipt,
    handle: &'r str,
    outcome: DeleteOutcome,
    /// Why it is undone when the server answered for it: refused for
    /// another reason than staleness, or left unanswered.
    refused: Option<Error>,
}

/// What became of a receipt of a `delete_batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeleteOutcome {
    Deleted,
    /// Refused as stale, or of another queue: its message untouched.
    Stale,
    /// Not known to be deleted: its request failed or was not sent, or the
    /// server refused it for another reason.
    Undone,
}

/// The place, in a batch request of `n` entries, of the entry an answer
/// names by `id`: the entries' ids are their places (`0` to `n - 1`). `None`
/// for an id the request did not send.
fn entry_place(id: &str, n: usize) -> Option<usize> {
    id.parse::<usize>().ok().filter(|&i| i < n)
}

/// A message ready for SQS: validated, its attributes in SQS's form, its
/// deduplication id, and the bytes SQS counts of it.
struct Outgoing<'m> {
    message: &'m SendMessage,
    attributes: HashMap<String, MessageAttributeValue>,
    dedup_id: Option<String>,
    /// [`sqs_size`] of the body and `attributes`.
    bytes: usize,
}

impl Outgoing<'_> {
    /// What the message counts toward a SendMessageBatch request's limit:
    /// its size as SQS documents it (the sum of the messages' sizes) and,
    /// as a margin for accounting SQS does not document, the entry's id
    /// (one digit), group id and deduplication id, at most 2,570 bytes a
    /// request. A request cut one message early costs a request; one that
    /// SQS refuses fails the call.
    fn batch_bytes(&self) -> usize {
        let id = |i: &Option<String>| i.as_ref().map_or(0, String::len);
        self.bytes + 1 + id(&self.message.group_id) + id(&self.dedup_id)
    }
}

/// The SendMessageBatch requests a batch goes out in, in order: at most 10
/// messages each, and at most `limit` bytes of them together, each message
/// counted at its entry of `bytes`. A message over `limit` on its own goes
/// alone (a message `prepare` let through fits a SendMessage of its own).
fn batch_requests(bytes: &[usize], limit: usize) -> Vec<Range<usize>> {
    let mut requests: Vec<Range<usize>> = Vec::new();
    let mut total = 0;
    for (i, &b) in bytes.iter().enumerate() {
        match requests.last_mut() {
            Some(r) if r.len() < SQS_BATCH && total + b <= limit => {
                r.end = i + 1;
                total += b;
            }
            _ => {
                requests.push(i..i + 1);
                total = b;
            }
        }
    }
    requests
}

/// The bytes SQS counts of a message toward its size limit: the body and,
/// of each attribute, its name, its data type (custom label included) and
/// its value, a string's UTF-8 bytes or a binary's bytes ("all parts of
/// the message attribute, including name, type, and value, are part of
/// the message size restriction").
fn sqs_size(body: &str, attributes: &HashMap<String, MessageAttributeValue>) -> usize {
    let attribute = |(name, v): (&String, &MessageAttributeValue)| {
        name.len()
            + v.data_type().len()
            + v.string_value().map_or(0, str::len)
            + v.binary_value().map_or(0, |b| b.as_ref().len())
    };
    body.len() + attributes.iter().map(attribute).sum::<usize>()
}

/// How a redrive takes messages from the dead-letter queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RedriveReceive {
    /// Messages per ReceiveMessage request.
    max_messages: usize,
    /// The request's long-polling wait.
    wait: Duration,
    /// How long a received message stays hidden in the dead-letter queue.
    visibility: Duration,
}

/// One message per request, hidden for as long as the request, its
/// re-send and its delete can take together: each call ends within the
/// operation `timeout` (the SDK cuts it off there, retries included), the
/// receive within `timeout` plus its wait. The message is hidden no earlier
/// than the receive started, and the delete reaches SQS no later than
/// `3 * timeout + wait` after that, so the message is not visible again in
/// the dead-letter queue, for another redrive to take, while this one moves
/// it. (A batch of 10 held for `3 * timeout` ran out for the last messages
/// once the calls before them took long enough.)
///
/// The wait is a second, so the request long-polls: SQS then asks all of
/// its servers, where a request that does not wait asks some of them and
/// may come back empty from a queue that is not, which would end the
/// redrive early.
fn redrive_receive(timeout: Duration) -> RedriveReceive {
    let wait = Duration::from_secs(1);
    RedriveReceive {
        max_messages: 1,
        wait,
        visibility: timeout * 3 + wait,
    }
}

/// The attributes a redriven message is re-sent with: its own, and the
/// `pgonce.id` attribute carrying `id` where SQS leaves room for it (10
/// attributes, and `limit` bytes with the body). A message sent by another
/// producer may leave none: it moves under a new id rather than not at
/// all (SQS would refuse it).
fn carry_id(
    body: &str,
    attributes: HashMap<String, MessageAttributeValue>,
    id: &str,
    limit: usize,
) -> HashMap<String, MessageAttributeValue> {
    if attributes.contains_key(ID_ATTRIBUTE) {
        return attributes;
    }
    let mut with_id = attributes.clone();
    with_id.insert(ID_ATTRIBUTE.to_string(), string_attribute(id));
    if with_id.len() <= SQS_MAX_ATTRIBUTES && sqs_size(body, &with_id) <= limit {
        return with_id;
    }
    tracing::warn!(
        id,
        "redriven message has no room (10 attributes, or SQS's size limit) for its pgonce id"
    );
    attributes
}

/// What a receipt of an SQS queue names: the handle SQS issued for one
/// delivery, and the queue that issued it. Text form `<queue>:<handle>`;
/// SQS queue names hold no `:`, so the first one ends the name, and the
/// handle is SQS's as it was issued.
///
/// SQS takes a handle at any queue's URL: moto acts on the message under
/// it wherever that message is now (a dead-lettered message keeps its
/// handles), and SQS documents no refusal either. The queue's name in the
/// receipt lets pgonce refuse another queue's receipt itself, before any
/// request, as the contract says. A receipt not of this form is refused
/// too, including a bare SQS handle, as `pgonce-sqs` issued receipts before
/// they named their queue: such a delivery is not deleted and comes back
/// after its visibility timeout (at least once), where accepting bare
/// handles would keep another queue's handle acting on this queue's
/// messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ReceiptParts<'a> {
    queue: &'a str,
    handle: &'a str,
}

impl<'a> ReceiptParts<'a> {
    /// The parts of `text` when it is of the form issued: a queue name SQS
    /// takes, `:`, a handle of at least one character.
    fn parse(text: &'a str) -> Option<ReceiptParts<'a>> {
        let (queue, handle) = text.split_once(':')?;
        (sqs_queue_name(queue) && !handle.is_empty()).then_some(ReceiptParts { queue, handle })
    }

    fn receipt(&self) -> Receipt {
        Receipt(format!("{}:{}", self.queue, self.handle))
    }
}

/// A receive's stop signal, looked at between requests: [`Stop::raised`]
/// polls it once without waiting, and once it has resolved says so ever
/// after without polling it again (a finished future must not be polled).
struct Stop<F> {
    signal: Pin<Box<F>>,
    raised: bool,
}

impl<F: Future<Output = ()>> Stop<F> {
    fn new(signal: F) -> Stop<F> {
        Stop {
            signal: Box::pin(signal),
            raised: false,
        }
    }

    fn raised(&mut self) -> bool {
        if !self.raised {
            self.raised = self.signal.as_mut().now_or_never().is_some();
        }
        self.raised
    }
}

/// Decrements the receive counter when the call ends or is dropped.
struct Receiving<'a>(&'a AtomicUsize);

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Checks a queue's name and attributes against what SQS takes, before any
/// request. `QueueAttributes::validate` refuses a visibility timeout past
/// 12 hours, a retention past 14 days and a delay past 15 minutes, which
/// are SQS's limits too; the shorter retention SQS refuses is refused here.
fn validate(name: &str, attributes: &QueueAttributes) -> Result<()> {
    attributes.validate()?;
    let invalid = |why: String| {
        Err(Error::Invalid {
            what: "SQS queue attributes",
            why,
        })
    };
    if !sqs_queue_name(name) {
        return invalid("names are 1 to 80 of A-Z a-z 0-9 - _ (FIFO: then .fifo)".into());
    }
    if attributes.fifo != name.ends_with(".fifo") {
        return invalid("a FIFO queue's name ends in .fifo, and only a FIFO queue's".into());
    }
    if attributes.retention < Duration::from_secs(60)
        || attributes.retention > Duration::from_secs(14 * 24 * 3600)
    {
        return invalid("SQS retention is 60 s to 14 days".into());
    }
    if attributes.dedup_window != SQS_DEDUP_WINDOW {
        return invalid(format!(
            "the SQS deduplication window is fixed at {SQS_DEDUP_WINDOW:?}"
        ));
    }
    if attributes.content_based_dedup && !attributes.fifo {
        return invalid("content-based deduplication needs a FIFO queue".into());
    }
    if attributes
        .max_receive_count
        .is_some_and(|n| !(1..=1000).contains(&n))
    {
        return invalid("SQS max receive count is 1 to 1000".into());
    }
    Ok(())
}

/// The attributes of a CreateQueue request for `attributes` (validated),
/// but the dead-letter queue's. Durations are whole seconds rounded up, as
/// every duration this backend sends (a receive's visibility and wait, a
/// message's delay, a visibility change): never less than asked, and
/// within SQS's limits whenever the duration is, those being whole
/// seconds.
fn sqs_attributes(attributes: &QueueAttributes) -> HashMap<QueueAttributeName, String> {
    let secs = |d: Duration| ceil_secs(d).to_string();
    let mut attrs = HashMap::from([
        (
            QueueAttributeName::VisibilityTimeout,
            secs(attributes.visibility_timeout),
        ),
        (
            QueueAttributeName::MessageRetentionPeriod,
            secs(attributes.retention),
        ),
        (QueueAttributeName::DelaySeconds, secs(attributes.delay)),
    ]);
    if attributes.fifo {
        attrs.insert(QueueAttributeName::FifoQueue, "true".into());
        attrs.insert(
            QueueAttributeName::ContentBasedDeduplication,
            attributes.content_based_dedup.to_string(),
        );
    }
    attrs
}

/// Whether SQS takes `name` as a queue name: 1 to 80 characters of A-Z
/// a-z 0-9 - _, the last five `.fifo` for a FIFO queue.
fn sqs_queue_name(name: &str) -> bool {
    let base = name.strip_suffix(".fifo").unwrap_or(name);
    !base.is_empty()
        && name.len() <= 80
        && base
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// The queue name in a RedrivePolicy's deadLetterTargetArn.
fn dead_letter_name(policy: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(policy).ok()?;
    let arn = v.get("deadLetterTargetArn")?.as_str()?;
    arn.rsplit(':').next().map(str::to_string)
}

/// `m` as delivered by the queue named `queue` (its receipt names it),
/// hidden for `visibility` from the request (its attempt that answered)
/// sent at `requested_at`.
fn to_received(
    m: &Message,
    queue: &str,
    visibility: Duration,
    requested_at: Instant,
) -> Result<Received> {
    let system = |name: MessageSystemAttributeName| {
        m.attributes()
            .and_then(|a| a.get(&name))
            .map(String::as_str)
    };
    let mut attributes = BTreeMap::new();
    let mut id = m.message_id().unwrap_or_default().to_string();
    for (k, v) in m.message_attributes().into_iter().flatten() {
        let value = attribute_text(v);
        if k == ID_ATTRIBUTE {
            id = value;
        } else {
            attributes.insert(k.clone(), value);
        }
    }
    let sent_ms: u64 = system(MessageSystemAttributeName::SentTimestamp)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok(Received {
        id,
        body: m.body().unwrap_or_default().to_string(),
        attributes,
        group_id: system(MessageSystemAttributeName::MessageGroupId).map(str::to_string),
        receive_count: system(MessageSystemAttributeName::ApproximateReceiveCount)
            .and_then(|s| s.parse().ok())
            .unwrap_or(1),
        sent_at: UNIX_EPOCH + Duration::from_millis(sent_ms),
        receipt: ReceiptParts {
            queue,
            handle: m
                .receipt_handle()
                .ok_or_else(|| backend_error("a received message has no receipt handle"))?,
        }
        .receipt(),
        visibility: Some(visibility),
        requested_at,
    })
}

/// Whether SQS takes `s` as a body or a string attribute value: XML's
/// characters (`#x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD |
/// #x10000-#x10FFFF`; a `str` holds no surrogates).
fn sqs_text(s: &str) -> bool {
    s.chars()
        .all(|c| matches!(c, '\t' | '\n' | '\r' | ' '..='\u{FFFD}' | '\u{10000}'..))
}

/// Whether SQS takes `name` as a message attribute name.
fn sqs_attribute_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    (1..=256).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
}

/// An attribute's value as [`Received::attributes`] holds it: a String's
/// or a Number's string value (of a custom type label too), a Binary's
/// bytes in standard base64 (RFC 4648, padded), from which they decode
/// unchanged.
fn attribute_text(v: &MessageAttributeValue) -> String {
    match (v.string_value(), v.binary_value()) {
        (Some(s), _) => s.to_string(),
        (None, Some(b)) => aws_smithy_types::base64::encode(b.as_ref()),
        (None, None) => String::new(),
    }
}

fn string_attribute(v: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(v)
        .build()
        .expect("data_type is set")
}

fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

fn fresh_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

fn backend_error(message: &str) -> Error {
    Error::Backend {
        backend: BACKEND,
        code: "Unexpected".into(),
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use aws_sdk_sqs::primitives::Blob;

    use super::*;

    fn typed(
        data_type: &str,
        string: Option<&str>,
        binary: Option<&[u8]>,
    ) -> MessageAttributeValue {
        MessageAttributeValue::builder()
            .data_type(data_type)
            .set_string_value(string.map(str::to_string))
            .set_binary_value(binary.map(|b| Blob::new(b.to_vec())))
            .build()
            .unwrap()
    }

    /// SQS counts each attribute's name, data type and value toward a
    /// message's size, whatever its type.
    #[test]
    fn the_size_counts_each_attributes_name_type_and_value() {
        let attributes = HashMap::from([
            ("s".to_string(), string_attribute("value")),
            ("n".to_string(), typed("Number.int", Some("42"), None)),
            ("b".to_string(), typed("Binary", None, Some(&[0, 1, 255]))),
        ]);
        let expected = "body".len()
            + ("s".len() + "String".len() + "value".len())
            + ("n".len() + "Number.int".len() + "42".len())
            + ("b".len() + "Binary".len() + 3);
        assert_eq!(sqs_size("body", &attributes), expected);
    }

    /// Two messages that fit one request by their bodies and attribute
    /// names and values, but not with their attributes' data types, go in
    /// two requests. (The attributes' types were left out: both went in one
    /// request, 8 bytes over SQS's limit, which SQS refuses whole.)
    #[test]
    fn a_batch_is_split_where_its_attribute_types_pass_the_limit() {
        let attributes = HashMap::from([("k".to_string(), string_attribute(&"v".repeat(10)))]);
        let body = "x".repeat(SQS_MAX_MESSAGE_BYTES / 2 - 11 - 2);
        let one = sqs_size(&body, &attributes) + 1;
        let requests = batch_requests(&[one, one], SQS_MAX_MESSAGE_BYTES);
        assert_eq!(requests, [0..1, 1..2], "each message counts {one} bytes");
        assert_eq!(
            one,
            SQS_MAX_MESSAGE_BYTES / 2 + 5,
            "body, k, String, 10 v, entry id"
        );
    }

    /// Requests hold at most 10 messages and at most the limit together, in
    /// the batch's order; a message over the limit alone goes alone.
    #[test]
    fn batch_requests_hold_ten_messages_and_the_limit_at_most() {
        assert_eq!(batch_requests(&[1; 25], 100), [0..10, 10..20, 20..25]);
        assert_eq!(batch_requests(&[40, 40, 40, 40], 100), [0..2, 2..4]);
        assert_eq!(batch_requests(&[10, 150, 10, 10], 100), [0..1, 1..2, 2..4]);
        assert_eq!(batch_requests(&[50, 50, 1], 100), [0..2, 2..3]);
    }

    /// A redrive holds each message in the dead-letter queue for as long as
    /// its receive, its re-send and its delete can take, each bounded by the
    /// operation timeout, and long-polls, so an empty answer means an empty
    /// queue. (It received 10 messages at a time, held for 3 operation
    /// timeouts, without waiting: the last of them were visible again for
    /// another redrive once the calls before them had taken long enough.)
    #[test]
    fn a_redrive_holds_each_message_until_its_delete_and_long_polls() {
        for timeout in [
            Duration::from_millis(100),
            Duration::from_secs(10),
            Duration::from_secs(300),
        ] {
            let take = redrive_receive(timeout);
            let longest = timeout * (1 + 2 * take.max_messages as u32) + take.wait;
            assert!(take.visibility >= longest, "{timeout:?}: {take:?}");
            assert!(
                take.visibility <= Duration::from_secs(12 * 3600),
                "{take:?}"
            );
            assert!(take.wait >= Duration::from_secs(1), "{take:?}");
        }
    }

    /// A redrive adds the pgonce id where SQS leaves room for it, and
    /// leaves it out where the message would then be over SQS's size limit
    /// (or its 10 attributes); a carried id is kept.
    #[test]
    fn the_pgonce_id_is_carried_where_it_fits() {
        let id = uuid::Uuid::new_v4().to_string();
        let room = |body: &str, attributes| carry_id(body, attributes, &id, 1000);
        assert!(room("x", HashMap::new()).contains_key(ID_ATTRIBUTE));
        let fits = "x".repeat(1000 - ID_ATTRIBUTE_BYTES);
        assert!(room(&fits, HashMap::new()).contains_key(ID_ATTRIBUTE));
        let over = "x".repeat(1000 - ID_ATTRIBUTE_BYTES + 1);
        assert_eq!(room(&over, HashMap::new()), HashMap::new());
        let ten: HashMap<_, _> = (0..10)
            .map(|i| (format!("a{i}"), string_attribute("v")))
            .collect();
        assert_eq!(room("x", ten.clone()), ten);
        let carried = HashMap::from([(ID_ATTRIBUTE.to_string(), string_attribute(&id))]);
        assert_eq!(room(&over, carried.clone()), carried);
    }

    /// A receipt parses only in the form issued, `<queue>:<handle>` with a
    /// queue name SQS takes and a handle, which is kept as SQS issued it
    /// (colons and all). A bare SQS handle, as receipts were before they
    /// named their queue, is no receipt. (A receipt was the bare handle,
    /// and another queue's went to SQS, which acted on it.)
    #[test]
    fn receipts_parse_only_in_the_form_issued() {
        let issued = ReceiptParts {
            queue: "jobs-dlq.fifo",
            handle: "AQEB+x/y==:z",
        };
        assert_eq!(issued.receipt().0, "jobs-dlq.fifo:AQEB+x/y==:z");
        assert_eq!(ReceiptParts::parse(&issued.receipt().0), Some(issued));
        for text in [
            "AQEBzbVv1mUXH3Vqv5w", // a bare handle
            "",
            ":handle",
            "jobs:",
            "no space:handle",
            "dot.fifo.fifo:handle",
            &format!("{}:handle", "q".repeat(81)),
        ] {
            assert_eq!(ReceiptParts::parse(text), None, "{text:?}");
        }
    }

    /// A queue's durations go to SQS in whole seconds rounded up, as every
    /// other duration this backend sends (a visibility of 1.9 s hides a
    /// message for 2 s, never less than asked). (They were rounded down:
    /// 1.9 s became 1 s, and 0.5 s none at all.)
    #[test]
    fn queue_durations_are_sent_rounded_up() {
        let attributes = QueueAttributes {
            visibility_timeout: Duration::from_millis(1900),
            retention: Duration::from_millis(60_001),
            delay: Duration::from_millis(500),
            ..QueueAttributes::default()
        };
        let sent = sqs_attributes(&attributes);
        let secs = |name| sent.get(&name).map(String::as_str);
        assert_eq!(
            [
                secs(QueueAttributeName::VisibilityTimeout),
                secs(QueueAttributeName::MessageRetentionPeriod),
                secs(QueueAttributeName::DelaySeconds),
            ],
            [Some("2"), Some("61"), Some("1")]
        );
        let whole = sqs_attributes(&QueueAttributes::default());
        assert_eq!(whole[&QueueAttributeName::VisibilityTimeout], "30");
        assert_eq!(whole[&QueueAttributeName::DelaySeconds], "0");
    }

    /// What SQS refuses of a queue's durations is refused before any
    /// request, `Invalid`: a visibility timeout past 12 h, a retention
    /// outside 60 s to 14 days, a delay past 15 minutes, by any fraction
    /// of a second; at the limits the queue is created with them as sent.
    #[test]
    fn queue_durations_past_sqs_limits_are_invalid() {
        let ms = Duration::from_millis(1);
        let at = |visibility_timeout, retention, delay| QueueAttributes {
            visibility_timeout,
            retention,
            delay,
            ..QueueAttributes::default()
        };
        let (hours_12, minute, days_14, minutes_15) = (
            Duration::from_secs(12 * 3600),
            Duration::from_secs(60),
            Duration::from_secs(14 * 24 * 3600),
            Duration::from_secs(15 * 60),
        );
        for bad in [
            at(hours_12 + ms, minute, Duration::ZERO),
            at(Duration::ZERO, minute - ms, Duration::ZERO),
            at(Duration::ZERO, days_14 + ms, Duration::ZERO),
            at(Duration::ZERO, minute, minutes_15 + ms),
        ] {
            let got = validate("q", &bad);
            assert!(
                matches!(got, Err(Error::Invalid { .. })),
                "{bad:?}: {got:?}"
            );
        }
        for (good, sent) in [
            (at(hours_12, minute, minutes_15), ["43200", "60", "900"]),
            (
                at(Duration::ZERO, days_14, Duration::ZERO),
                ["0", "1209600", "0"],
            ),
        ] {
            validate("q", &good).unwrap();
            let attrs = sqs_attributes(&good);
            let got = [
                QueueAttributeName::VisibilityTimeout,
                QueueAttributeName::MessageRetentionPeriod,
                QueueAttributeName::DelaySeconds,
            ]
            .map(|name| attrs[&name].clone());
            assert_eq!(got, sent, "{good:?}");
        }
    }

    /// A Binary attribute's value reads as the standard base64 of its
    /// bytes, which decodes to them; String and Number values as sent.
    #[test]
    fn binary_attribute_values_read_as_base64() {
        let bytes = [0u8, 1, 255, b'x'];
        let text = attribute_text(&typed("Binary.gz", None, Some(&bytes)));
        assert_eq!(text, "AAH/eA==");
        assert_eq!(aws_smithy_types::base64::decode(&text).unwrap(), bytes);
        assert_eq!(attribute_text(&typed("Number", Some("-1.5"), None)), "-1.5");
        assert_eq!(attribute_text(&string_attribute("ü")), "ü");
    }

    /// A hand-back whose receipt SQS refuses (here: a handle moto does not
    /// know) is [`Error::StaleReceipt`], as every call's refused receipt
    /// is, naming the receipt. (The refused entry was mapped without its
    /// receipt: a `Backend` error, `ReceiptHandleIsInvalid`.)
    #[tokio::test]
    async fn a_release_refused_for_its_receipt_is_stale() {
        let moto = pgonce_testkit::Moto::start().unwrap_or_else(|e| panic!("{e}"));
        let sqs = SqsClient::connect(SqsConfig::local(moto.endpoint()))
            .await
            .unwrap();
        let q = sqs
            .create_queue("q", QueueAttributes::default())
            .await
            .unwrap();
        let refused = Receipt("q:no-such-handle".into());
        let got = q.release(std::slice::from_ref(&refused)).await;
        assert!(
            matches!(&got, Err(Error::StaleReceipt { receipt }) if *receipt == refused.0),
            "{got:?}"
        );
    }
}
