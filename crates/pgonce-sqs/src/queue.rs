//! [`SqsQueue`]: the [`Queue`] trait on one SQS queue.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, UNIX_EPOCH};

use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry, Message,
    MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use pgonce::queue::{MAX_BATCH, MAX_BODY_BYTES};
use pgonce::{
    Error, Queue, QueueAttributes, QueueStats, Receipt, ReceiveRequest, Received, Result,
    SendMessage, Sent,
};

use crate::SqsConfig;
use crate::error::{BACKEND, from_code, map};

/// The message attribute that carries a message's pgonce id across a
/// redrive (SQS gives the re-sent copy a new MessageId).
const ID_ATTRIBUTE: &str = "pgonce.id";

/// SQS's cap on message attributes per message (one is `ID_ATTRIBUTE`
/// after a redrive, so a send takes one fewer).
const SQS_MAX_ATTRIBUTES: usize = 10;

/// SQS's per-request cap on messages (send, receive, delete batches).
const SQS_BATCH: usize = 10;

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
        let mut attrs = HashMap::new();
        let secs = |d: Duration| d.as_secs().to_string();
        attrs.insert(
            QueueAttributeName::VisibilityTimeout,
            secs(attributes.visibility_timeout),
        );
        attrs.insert(
            QueueAttributeName::MessageRetentionPeriod,
            secs(attributes.retention),
        );
        attrs.insert(QueueAttributeName::DelaySeconds, secs(attributes.delay));
        if attributes.fifo {
            attrs.insert(QueueAttributeName::FifoQueue, "true".into());
            attrs.insert(
                QueueAttributeName::ContentBasedDeduplication,
                attributes.content_based_dedup.to_string(),
            );
        }
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
        // Only a FIFO receive uses it (`top_up_fifo`); SQS's default is 30 s.
        let visibility = if fifo {
            let secs = self
                .attribute(&url, QueueAttributeName::VisibilityTimeout)
                .await?;
            Duration::from_secs(secs.and_then(|s| s.parse().ok()).unwrap_or(30))
        } else {
            Duration::ZERO
        };
        Ok(SqsQueue {
            inner: Arc::new(Inner {
                client: self.clone(),
                name: name.to_string(),
                url,
                fifo,
                content_based_dedup,
                visibility,
                dead_letter_url,
                receiving: AtomicUsize::new(0),
            }),
        })
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
            .map_err(|e| map(e, None))?;
        Ok(out.attributes().and_then(|a| a.get(&name)).cloned())
    }
}

/// One SQS queue. Cheap to clone (the clones share one client).
///
/// Differences from the contract in `pgonce::queue`, because SQS cannot do
/// otherwise (the tests state each):
///
/// * **Receipts are not fenced by pgonce.** SQS issues an opaque handle per
///   delivery, and a handle names a message of the queue that issued it
///   (its delete or visibility change goes to that queue's URL), but SQS
///   accepts an earlier delivery's handle ("the request succeeds, but the
///   message might not be deleted"), and so does moto: a handle from before
///   a redelivery, or from before a redrive, may still delete or hide the
///   message. [`Error::StaleReceipt`] is returned only when the server
///   refuses a handle. The PostgreSQL queue refuses every receipt but the
///   current delivery's in its own queue. Handlers must be idempotent anyway
///   (at least once); pgonce's database safeguards, not the queue, keep
///   invariants true.
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
///   after a quarter of the visibility timeout (given, or the queue's, read
///   when the handle is opened), so a slow server hands out a smaller batch
///   rather than messages whose visibility ran out while it filled; with a
///   visibility of zero a FIFO receive returns one message.
/// * **Messages** are refused with [`Error::Invalid`] before any request
///   where SQS would refuse them or store them altered: bodies and
///   attribute values of XML characters only (no control characters but
///   tab, CR and LF), group and deduplication ids of printable ASCII,
///   attribute names as SQS takes them, and at most 9 attributes (SQS
///   takes 10; a redrive adds the `pgonce.id` attribute).
/// * **Batches** (`send_batch`) go out in requests of 10 and are not
///   atomic: on an error, earlier requests' messages stay sent, and so do
///   the entries SQS took of a request that it refused in part (throttled
///   or refused by KMS, for instance). The error is the first refused
///   entry's; sending the whole batch again is safe on a FIFO queue within
///   the deduplication window, and sends duplicates on a standard queue.
/// * **Visibility** of one delivery ends at most 12 hours after its
///   receive: SQS refuses a `change_visibility` that would reach past that
///   ([`Error::Backend`], `InvalidParameterValue`, not `StaleReceipt`).
///   A worker's heartbeats then fail (logged), and a handler still running
///   sees its message delivered again; the PostgreSQL queue extends a
///   delivery without limit.
/// * **Stats** have no `oldest_age` (SQS reports it to CloudWatch only).
/// * **Redrive** (called on a dead-letter queue) re-sends each visible
///   message to the one source queue and deletes it from the dead-letter
///   queue; the message keeps its attributes (of any SQS type) and its
///   pgonce id (carried in the `pgonce.id` attribute) and starts with a
///   fresh receive count. A message sent by another producer with SQS's
///   10 attributes leaves no room for the id: it moves under a new one.
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
    /// The FIFO queue's visibility timeout (read when the handle is
    /// opened): see `top_up_fifo`.
    visibility: Duration,
    dead_letter_url: Option<String>,
    /// Receive calls under way (the tests' "parked" signal).
    receiving: AtomicUsize,
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

    fn sdk(&self) -> &aws_sdk_sqs::Client {
        &self.inner.client.client
    }

    fn config(&self) -> &SqsConfig {
        &self.inner.client.config
    }

    /// Validates for SQS; fills in what SQS requires.
    fn prepare(&self, message: &SendMessage) -> Result<()> {
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
        Ok(())
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
        let messages = self.receive_raw(max, wait, visibility).await?;
        let mut got = Vec::new();
        let mut groups = HashSet::new();
        let mut release = Vec::new();
        for m in &messages {
            let received = to_received(m)?;
            if self.inner.fifo
                && let Some(g) = &received.group_id
                && !groups.insert(g.clone())
            {
                release.push(received.receipt);
                continue;
            }
            got.push(received);
        }
        if !release.is_empty() {
            self.release(&release).await?;
        }
        metrics::counter!("pgonce_sqs_received_total", "queue" => self.inner.name.clone())
            .increment(got.len() as u64);
        Ok(got)
    }

    /// One ReceiveMessage request: its messages as SQS returned them.
    async fn receive_raw(
        &self,
        max: usize,
        wait: Duration,
        visibility: Option<Duration>,
    ) -> Result<Vec<Message>> {
        let mut call = self
            .sdk()
            .receive_message()
            .queue_url(&self.inner.url)
            .max_number_of_messages(max.min(SQS_BATCH) as i32)
            .wait_time_seconds(ceil_secs(wait) as i32)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All");
        if let Some(v) = visibility {
            call = call.visibility_timeout(ceil_secs(v) as i32);
        }
        let out = call
            .customize()
            .config_override(
                aws_sdk_sqs::config::Builder::default()
                    .timeout_config(self.config().timeouts(wait)),
            )
            .send()
            .await
            .map_err(|e| map(e, None))?;
        Ok(out.messages.unwrap_or_default())
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
    async fn top_up_fifo(&self, mut got: Vec<Received>, request: &ReceiveRequest) -> Vec<Received> {
        let started = Instant::now();
        let visibility = Duration::from_secs(ceil_secs(
            request.visibility.unwrap_or(self.inner.visibility),
        ));
        let mut groups: HashSet<String> = got.iter().filter_map(|m| m.group_id.clone()).collect();
        while got.len() < request.max_messages && started.elapsed() < visibility / 4 {
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

    /// Makes these deliveries visible again at once.
    async fn release(&self, receipts: &[Receipt]) -> Result<()> {
        let entries = receipts
            .iter()
            .enumerate()
            .map(|(i, r)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(&r.0)
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
            .map_err(|e| map(e, None))?;
        match out.failed().first() {
            Some(f) => Err(from_code(f.code(), f.message().unwrap_or_default(), None)),
            None => Ok(()),
        }
    }

    async fn counts(&self, url: &str) -> Result<(u64, u64, u64)> {
        let out = self
            .sdk()
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            .send()
            .await
            .map_err(|e| map(e, None))?;
        let get = |name: QueueAttributeName| -> u64 {
            out.attributes()
                .and_then(|a| a.get(&name))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Ok((
            get(QueueAttributeName::ApproximateNumberOfMessages),
            get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
            get(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
        ))
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
        self.prepare(&message)?;
        let out = self
            .sdk()
            .send_message()
            .queue_url(&self.inner.url)
            .message_body(&message.body)
            .set_message_attributes(Some(Self::attributes(&message)))
            .set_message_group_id(message.group_id.clone())
            .set_message_deduplication_id(self.dedup_id(&message))
            .set_delay_seconds(message.delay.map(|d| ceil_secs(d) as i32))
            .send()
            .await
            .map_err(|e| map(e, None))?;
        metrics::counter!("pgonce_sqs_sent_total", "queue" => self.inner.name.clone()).increment(1);
        Ok(Sent {
            id: out.message_id().unwrap_or_default().to_string(),
            duplicate: false,
        })
    }

    async fn send_batch(&self, messages: Vec<SendMessage>) -> Result<Vec<Sent>> {
        if messages.is_empty() || messages.len() > MAX_BATCH {
            return Err(Error::Invalid {
                what: "batch",
                why: format!("a batch holds 1 to {MAX_BATCH} messages"),
            });
        }
        for m in &messages {
            self.prepare(m)?;
        }
        // Requests of at most 10 messages and 256 KiB.
        let mut chunks: Vec<Vec<&SendMessage>> = Vec::new();
        let mut bytes = 0;
        for m in &messages {
            let size = m.body.len()
                + m.attributes
                    .iter()
                    .map(|(k, v)| k.len() + v.len())
                    .sum::<usize>();
            match chunks.last_mut() {
                Some(c) if c.len() < SQS_BATCH && bytes + size <= MAX_BODY_BYTES => {
                    c.push(m);
                    bytes += size;
                }
                _ => {
                    chunks.push(vec![m]);
                    bytes = size;
                }
            }
        }
        let mut sent = Vec::with_capacity(messages.len());
        for chunk in chunks {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(&m.body)
                        .set_message_attributes(Some(Self::attributes(m)))
                        .set_message_group_id(m.group_id.clone())
                        .set_message_deduplication_id(self.dedup_id(m))
                        .set_delay_seconds(m.delay.map(|d| ceil_secs(d) as i32))
                        .build()
                        .map_err(|e| backend_error(&e.to_string()))
                })
                .collect::<Result<Vec<_>>>()?;
            let out = self
                .sdk()
                .send_message_batch()
                .queue_url(&self.inner.url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| map(e, None))?;
            if let Some(f) = out.failed().first() {
                return Err(from_code(f.code(), f.message().unwrap_or_default(), None));
            }
            let ids: HashMap<&str, &str> = out
                .successful()
                .iter()
                .map(|s| (s.id(), s.message_id()))
                .collect();
            for i in 0..chunk.len() {
                let id = ids
                    .get(i.to_string().as_str())
                    .ok_or_else(|| backend_error("SendMessageBatch left an entry unanswered"))?;
                sent.push(Sent {
                    id: id.to_string(),
                    duplicate: false,
                });
            }
        }
        metrics::counter!("pgonce_sqs_sent_total", "queue" => self.inner.name.clone())
            .increment(sent.len() as u64);
        Ok(sent)
    }

    async fn receive(&self, request: ReceiveRequest) -> Result<Vec<Received>> {
        request.validate()?;
        self.inner.receiving.fetch_add(1, Ordering::SeqCst);
        let _guard = Receiving(&self.inner.receiving);
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
            let got = self
                .receive_once(per_request, left.min(SQS_MAX_WAIT), request.visibility)
                .await?;
            if !got.is_empty() && self.inner.fifo {
                return Ok(self.top_up_fifo(got, &request).await);
            }
            if !got.is_empty() || left <= SQS_MAX_WAIT {
                return Ok(got);
            }
        }
    }

    async fn delete(&self, receipt: &Receipt) -> Result<()> {
        self.sdk()
            .delete_message()
            .queue_url(&self.inner.url)
            .receipt_handle(&receipt.0)
            .send()
            .await
            .map_err(|e| map(e, Some(&receipt.0)))?;
        Ok(())
    }

    async fn delete_batch(&self, receipts: &[Receipt]) -> Result<Vec<Receipt>> {
        if receipts.len() > MAX_BATCH {
            return Err(Error::Invalid {
                what: "batch",
                why: format!("a batch holds at most {MAX_BATCH} receipts"),
            });
        }
        let mut stale = Vec::new();
        for chunk in receipts.chunks(SQS_BATCH) {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(&r.0)
                        .build()
                        .map_err(|e| backend_error(&e.to_string()))
                })
                .collect::<Result<Vec<_>>>()?;
            let out = self
                .sdk()
                .delete_message_batch()
                .queue_url(&self.inner.url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| map(e, None))?;
            let mut failed: Vec<(usize, Error)> = Vec::new();
            for f in out.failed() {
                let i: usize = f
                    .id()
                    .parse()
                    .map_err(|_| backend_error("unknown batch id"))?;
                let receipt = &chunk[i].0;
                failed.push((
                    i,
                    from_code(f.code(), f.message().unwrap_or_default(), Some(receipt)),
                ));
            }
            failed.sort_by_key(|(i, _)| *i);
            for (i, e) in failed {
                match e {
                    Error::StaleReceipt { .. } => stale.push(chunk[i].clone()),
                    other => return Err(other),
                }
            }
        }
        Ok(stale)
    }

    async fn change_visibility(&self, receipt: &Receipt, timeout: Duration) -> Result<()> {
        if timeout > Duration::from_secs(12 * 3600) {
            return Err(Error::Invalid {
                what: "visibility timeout",
                why: "at most 12 hours".into(),
            });
        }
        self.sdk()
            .change_message_visibility()
            .queue_url(&self.inner.url)
            .receipt_handle(&receipt.0)
            .visibility_timeout(ceil_secs(timeout) as i32)
            .send()
            .await
            .map_err(|e| map(e, Some(&receipt.0)))?;
        Ok(())
    }

    /// SQS purges asynchronously (up to 60 s) and once per 60 s per queue;
    /// the count is the approximate number of messages before the purge.
    async fn purge(&self) -> Result<u64> {
        let (depth, in_flight, delayed) = self.counts(&self.inner.url).await?;
        self.sdk()
            .purge_queue()
            .queue_url(&self.inner.url)
            .send()
            .await
            .map_err(|e| map(e, None))?;
        Ok(depth + in_flight + delayed)
    }

    async fn stats(&self) -> Result<QueueStats> {
        let (depth, in_flight, delayed) = self.counts(&self.inner.url).await?;
        let dead_letter_depth = match &self.inner.dead_letter_url {
            Some(url) => {
                let (d, f, l) = self.counts(url).await?;
                Some(d + f + l)
            }
            None => None,
        };
        Ok(QueueStats {
            depth,
            in_flight,
            delayed,
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
            .map_err(|e| map(e, None))?;
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
        let mut moved = 0;
        loop {
            // Every message received is moved, in the order received (a
            // FIFO group's in its order), so none is released.
            let batch = self
                .receive_raw(
                    SQS_BATCH,
                    Duration::ZERO,
                    Some(self.config().operation_timeout * 3),
                )
                .await?;
            if batch.is_empty() {
                return Ok(moved);
            }
            for raw in batch {
                let m = to_received(&raw)?;
                // The attributes as sent, of whatever type (a producer
                // outside pgonce may send Number and Binary ones), and the
                // pgonce id, when SQS's 10 leave room for it: a message
                // that already has 10 is moved under a new id rather than
                // not at all.
                let mut attributes = raw.message_attributes.unwrap_or_default();
                if attributes.contains_key(ID_ATTRIBUTE) || attributes.len() < SQS_MAX_ATTRIBUTES {
                    attributes.insert(ID_ATTRIBUTE.to_string(), string_attribute(&m.id));
                } else {
                    tracing::warn!(queue = %self.inner.name, id = %m.id,
                        "redriven message has 10 attributes, none left for its pgonce id");
                }
                // Sent first, deleted second: a crash in between leaves a
                // copy in both queues (at least once), never none.
                self.sdk()
                    .send_message()
                    .queue_url(&source)
                    .message_body(&m.body)
                    .set_message_attributes(Some(attributes))
                    .set_message_group_id(m.group_id.clone().filter(|_| source_fifo))
                    .set_message_deduplication_id(source_fifo.then(fresh_id))
                    .send()
                    .await
                    .map_err(|e| map(e, None))?;
                self.delete(&m.receipt).await?;
                moved += 1;
            }
        }
    }
}

/// Decrements the receive counter when the call ends or is dropped.
struct Receiving<'a>(&'a AtomicUsize);

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn validate(name: &str, attributes: &QueueAttributes) -> Result<()> {
    attributes.validate()?;
    let invalid = |why: String| {
        Err(Error::Invalid {
            what: "SQS queue attributes",
            why,
        })
    };
    let base = name.strip_suffix(".fifo").unwrap_or(name);
    if base.is_empty()
        || name.len() > 80
        || !base
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
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

/// The queue name in a RedrivePolicy's deadLetterTargetArn.
fn dead_letter_name(policy: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(policy).ok()?;
    let arn = v.get("deadLetterTargetArn")?.as_str()?;
    arn.rsplit(':').next().map(str::to_string)
}

fn to_received(m: &Message) -> Result<Received> {
    let system = |name: MessageSystemAttributeName| {
        m.attributes()
            .and_then(|a| a.get(&name))
            .map(String::as_str)
    };
    let mut attributes = BTreeMap::new();
    let mut id = m.message_id().unwrap_or_default().to_string();
    for (k, v) in m.message_attributes().into_iter().flatten() {
        let value = v.string_value().unwrap_or_default().to_string();
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
        receipt: Receipt(
            m.receipt_handle()
                .ok_or_else(|| backend_error("a received message has no receipt handle"))?
                .to_string(),
        ),
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
