//! A queue with SQS semantics (pattern P6) and the worker runtime that
//! consumes it.
//!
//! [`Queue`] is the contract the worker runtime needs; it names no
//! PostgreSQL type, so Amazon SQS can implement it too. Bodies are strings,
//! attributes a string map, message ids and receipt handles opaque strings.
//!
//! The contract (invariant I6):
//!
//! * **At least once.** A received message stays in the queue, invisible for
//!   the visibility timeout; unless it is deleted by then, it becomes visible
//!   again and is redelivered. Nothing is lost when a consumer dies.
//! * **Fenced receipts.** A [`Receipt`] is good for exactly one delivery of
//!   one message in one queue. Every redelivery, dead-letter move, redrive
//!   and purge ends that delivery: from then on its receipt deletes and
//!   hides nothing and says so, [`crate::Error::StaleReceipt`]. A receipt
//!   presented to a queue that did not issue it, and a string that is no
//!   receipt at all, get the same refusal and touch nothing. In a
//!   [`Queue::delete_batch`] each receipt is judged on its own: an earlier
//!   delivery's receipt next to the current one of the same message is
//!   reported stale.
//! * **FIFO queues.** Strict order within a message group; at most one
//!   message of a group in flight; groups independent of each other.
//! * **Deduplication.** A send whose deduplication id was seen within the
//!   queue's window enqueues nothing and returns the original message id.
//! * **Dead letters.** A message received `max_receive_count` times is moved
//!   to the dead-letter queue on its next receive, with its history;
//!   [`Queue::redrive`] moves it back.
//!
//! Receipts are opaque to callers. The PostgreSQL queue's read
//! `<queue>:<id>:<generation>`: each message has a generation that every
//! receive, dead-letter move and redrive bumps (and the give-back of a
//! receive nobody waited for: "Cancel safety" below), and a delete or visibility
//! change acts only when the queue, the id and the generation all match
//! (a purge deletes the rows, and ids are never reused). Amazon SQS issues
//! an opaque handle per delivery too, which `SqsQueue` wraps with its
//! queue's name so that it refuses another queue's receipts itself, but SQS
//! does not refuse an earlier delivery's handle ("the request succeeds, but
//! the message might not be deleted"), so on SQS the fence between
//! deliveries does not hold and a late consumer may still delete or hide a
//! redelivered message: `SqsQueue` documents this, and
//! `conformance::Caveats::fences_receipts` skips those checks.
//!
//! Backends: [`PgQueue`] (this crate) and `SqsQueue` (crate `pgonce-sqs`,
//! Amazon SQS). The worker runtime: [`Worker`]. `conformance` (with this
//! crate's `conformance` feature) holds the test suite every backend must
//! pass; `conformance::Caveats` is where a backend states what its server
//! cannot do.
//!
//! # Cancel safety
//!
//! A caller may drop any call at any await (its own timeout, a `select!`,
//! a task aborted at shutdown). [`PgQueue`]'s sends, deletes and
//! visibility changes are one statement each, all or none (a batch too):
//! a dropped one either happened or did not, and its pooled connection
//! goes back to the pool outside any transaction once the statement has
//! ended. (A wake it would have sent parked receivers after its statement
//! may be lost: they find the message at their next poll.) A send the
//! caller did not see happen may be sent again: with a deduplication id,
//! within the queue's window, the queue keeps one copy.
//!
//! A receive dropped while it is parked (a long poll waiting for messages
//! to arrive) has delivered nothing. One dropped once a receive statement
//! was sent, which the server runs regardless, would deliver to nobody:
//! its statements run on one pooled connection, and the drop hands them to
//! a task of their own, which finishes them and gives such deliveries back
//! before that connection serves anyone else.
//! Each message still in that delivery is receivable again at once (a
//! FIFO group goes on), its receive not counted toward
//! `max_receive_count`, and the receipt nobody saw is stale; counted in
//! `pgonce_queue_deliveries_given_back_total`. Best effort still: a
//! give-back that fails (logged), one cut short by a runtime shutting
//! down, and a statement the server committed whose answer never came
//! back (the connection lost during its commit) leave those messages
//! invisible until their visibility timeout runs out, then delivered
//! again, at least once as the contract allows, that delivery counted
//! toward `max_receive_count` (in a FIFO queue, the message's group waits
//! behind it meanwhile). [`Queue::receive_or_stop`] stops a receive
//! without relying on any of this, on every backend.
//! [`PgQueue::send_in`] and [`PgQueue::send_batch_in`] run in the caller's
//! transaction: dropped, the message may or may not be written there; roll
//! the transaction back.
//!
//! ```no_run
//! use pgonce::{Handler, HandlerError, PgQueue, PgQueueOptions, Queue, QueueAttributes};
//! use pgonce::{Received, SendMessage, Worker, WorkerConfig};
//!
//! struct Print;
//!
//! impl Handler for Print {
//!     // Runs with no database connection held; may run twice per message.
//!     async fn handle(&self, message: &Received) -> Result<(), HandlerError> {
//!         println!("{}", message.body);
//!         Ok(())
//!     }
//! }
//!
//! # async fn f(pool: sqlx::PgPool) -> pgonce::Result<()> {
//! let attributes = QueueAttributes::default().visibility_timeout(std::time::Duration::from_secs(60));
//! let queue = PgQueue::create(&pool, "orders", attributes, PgQueueOptions::default()).await?;
//! queue.send(SendMessage::new(r#"{"order": 17}"#)).await?;
//! let worker = Worker::new(queue, Print, WorkerConfig::default())?;
//! let done = worker
//!     .run(async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     })
//!     .await;
//! println!("{done:?}");
//! # Ok(()) }
//! ```

#[cfg(feature = "conformance")]
pub mod conformance;
mod postgres;
mod worker;

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use futures::FutureExt;

pub use postgres::{MessageHistory, PgQueue, PgQueueOptions, QueueAttributes};
pub use worker::{AckPolicy, Handler, HandlerError, Worker, WorkerConfig, WorkerCounters};

use crate::error::{Error, Result};

/// The largest message, in bytes: its body and its attributes' names and
/// values together (as in SQS: 256 KiB, attributes included; see
/// [`SendMessage::size`]).
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// The most messages one call sends, receives or deletes: the PostgreSQL
/// queue's limit. SQS takes 10 per request; its backend splits sends and
/// deletes into requests of 10 and receives at most 10.
pub const MAX_BATCH: usize = 1000;

/// The longest visibility timeout (as in SQS: 12 hours).
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);

/// The longest a receive waits for a message: 12 hours. A receive computes
/// its deadline from `wait`, so a wait has to be a time that exists.
pub const MAX_WAIT: Duration = Duration::from_secs(12 * 3600);

/// A message to send.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SendMessage {
    /// The body; 1 byte to [`MAX_BODY_BYTES`] (with the attributes), no
    /// NUL character.
    pub body: String,
    /// String attributes delivered with the message; they count toward
    /// [`MAX_BODY_BYTES`].
    pub attributes: BTreeMap<String, String>,
    /// FIFO queues: the message group (required). Standard queues: must be
    /// `None`.
    pub group_id: Option<String>,
    /// The deduplication id: a second send with the same id within the
    /// queue's window is a no-op returning the first message's id.
    pub dedup_id: Option<String>,
    /// Delivery delay; `None` uses the queue's.
    pub delay: Option<Duration>,
}

impl SendMessage {
    /// A message with this body and nothing else.
    pub fn new(body: impl Into<String>) -> SendMessage {
        SendMessage {
            body: body.into(),
            ..SendMessage::default()
        }
    }

    /// Sets the message group (FIFO queues).
    pub fn group(mut self, group_id: impl Into<String>) -> SendMessage {
        self.group_id = Some(group_id.into());
        self
    }

    /// Sets the deduplication id.
    pub fn dedup(mut self, dedup_id: impl Into<String>) -> SendMessage {
        self.dedup_id = Some(dedup_id.into());
        self
    }

    /// Sets an attribute.
    pub fn attribute(mut self, name: impl Into<String>, value: impl Into<String>) -> SendMessage {
        self.attributes.insert(name.into(), value.into());
        self
    }

    /// Sets the delivery delay.
    pub fn delay(mut self, delay: Duration) -> SendMessage {
        self.delay = Some(delay);
        self
    }

    /// The message's size as [`MAX_BODY_BYTES`] bounds it: the bytes of
    /// its body and of each attribute's name and value. SQS counts the
    /// attributes toward its limit too (with their data type, which the
    /// SQS backend adds).
    pub fn size(&self) -> usize {
        let attributes: usize = self.attributes.iter().map(|(k, v)| k.len() + v.len()).sum();
        self.body.len() + attributes
    }

    /// Checks what every backend requires; `fifo` is the queue's kind.
    pub fn validate(&self, fifo: bool) -> Result<()> {
        let invalid = |why: &str| Error::Invalid {
            what: "message",
            why: why.into(),
        };
        if self.body.is_empty() {
            return Err(invalid("the body is empty"));
        }
        // Attributes included: without them, a message of a short body
        // and attributes of any size went out, to a backend that refuses
        // it (SQS) or stores what SQS would not take.
        let size = self.size();
        if size > MAX_BODY_BYTES {
            return Err(Error::MessageTooLarge {
                size,
                max: MAX_BODY_BYTES,
            });
        }
        if self.body.contains('\0') {
            return Err(invalid("the body contains a NUL character"));
        }
        match (&self.group_id, fifo) {
            (None, true) => return Err(invalid("a FIFO queue needs a group id")),
            (Some(_), false) => return Err(invalid("a standard queue takes no group id")),
            (Some(g), true) if g.is_empty() || g.len() > 128 || g.contains('\0') => {
                return Err(invalid(
                    "the group id must be 1 to 128 characters, without NUL",
                ));
            }
            _ => {}
        }
        if let Some(d) = &self.dedup_id
            && (d.is_empty() || d.len() > 128 || d.contains('\0'))
        {
            return Err(invalid(
                "the deduplication id must be 1 to 128 characters, without NUL",
            ));
        }
        for (k, v) in &self.attributes {
            if k.is_empty() || k.contains('\0') || v.contains('\0') {
                return Err(invalid("attribute names must be non-empty, without NUL"));
            }
        }
        if self.delay.is_some_and(|d| d > Duration::from_secs(15 * 60)) {
            return Err(invalid("the delay is at most 15 minutes"));
        }
        Ok(())
    }
}

/// What a send did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    /// The message id; for a duplicate, the original message's.
    pub id: String,
    /// True when the deduplication id was seen within the window and
    /// nothing was enqueued.
    pub duplicate: bool,
}

/// A receive request. `Default`: 1 message, no waiting, the queue's
/// visibility timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiveRequest {
    /// At most this many messages (1 or more; backends cap it: SQS at 10).
    pub max_messages: usize,
    /// Long polling: with nothing to receive, wait up to this long for a
    /// message to arrive. Zero returns at once.
    pub wait: Duration,
    /// Overrides the queue's visibility timeout for these deliveries.
    pub visibility: Option<Duration>,
}

impl Default for ReceiveRequest {
    fn default() -> Self {
        ReceiveRequest {
            max_messages: 1,
            wait: Duration::ZERO,
            visibility: None,
        }
    }
}

impl ReceiveRequest {
    /// Up to `n` messages, no waiting.
    pub fn up_to(n: usize) -> ReceiveRequest {
        ReceiveRequest {
            max_messages: n,
            ..ReceiveRequest::default()
        }
    }

    /// Waits up to `wait` for a message.
    pub fn wait(mut self, wait: Duration) -> ReceiveRequest {
        self.wait = wait;
        self
    }

    /// Overrides the visibility timeout.
    pub fn visibility(mut self, visibility: Duration) -> ReceiveRequest {
        self.visibility = Some(visibility);
        self
    }

    /// What every backend requires: 1 to [`MAX_BATCH`] messages (a backend
    /// may deliver fewer: SQS at most 10), a visibility of at most
    /// [`MAX_VISIBILITY`] and a wait of at most [`MAX_WAIT`].
    pub fn validate(&self) -> Result<()> {
        let why = if self.max_messages == 0 || self.max_messages > MAX_BATCH {
            format!(
                "max_messages is 1 to {MAX_BATCH}, got {}",
                self.max_messages
            )
        } else if self.visibility.is_some_and(|v| v > MAX_VISIBILITY) {
            format!(
                "the visibility is at most 12 hours, got {:?}",
                self.visibility
            )
        } else if self.wait > MAX_WAIT {
            format!("the wait is at most 12 hours, got {:?}", self.wait)
        } else {
            return Ok(());
        };
        Err(Error::Invalid {
            what: "receive request",
            why,
        })
    }
}

/// An opaque receipt handle: names one delivery of one message in one
/// queue (see the module docs).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Receipt(pub String);

impl fmt::Debug for Receipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Receipt({})", self.0)
    }
}

impl fmt::Display for Receipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A delivered message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The message id, the same on every delivery (as [`Sent::id`] returned it).
    pub id: String,
    /// The body as sent.
    pub body: String,
    /// The attributes the message was sent with.
    pub attributes: BTreeMap<String, String>,
    /// The message group on a FIFO queue; `None` on a standard queue, but
    /// on Amazon SQS, whose fair queues let a producer give a standard
    /// queue's message a group: it is reported, and orders nothing.
    pub group_id: Option<String>,
    /// How many times this message has been delivered, this time included.
    pub receive_count: u32,
    /// When it was sent. On the PostgreSQL queue a time written by hand
    /// past what pgonce reads back (PostgreSQL's `infinity`) reads as the
    /// end of 9999 in UTC.
    pub sent_at: std::time::SystemTime,
    /// The receipt of this delivery, for delete and change_visibility.
    pub receipt: Receipt,
    /// How long this delivery hides the message, counted from
    /// [`Received::requested_at`]: the visibility the request asked for, as
    /// the backend took it (SQS: rounded up to whole seconds), or the
    /// queue's visibility timeout (SQS: as read when the handle was
    /// opened, which every receive of the handle asks SQS for). A later [`Queue::change_visibility`] changes the delivery,
    /// not this. A consumer knows from the two when its delivery runs out,
    /// `requested_at + visibility` at the earliest, whether or not it asked
    /// for a visibility: the worker stops its heartbeat there. `None`: the
    /// backend cannot tell.
    pub visibility: Option<Duration>,
    /// When the request that made this delivery began, by this process's
    /// clock: taken by the backend just before it sent the statement or
    /// request that delivered the message, so never after the server began
    /// counting [`Received::visibility`]. A long poll's wait before that
    /// statement is not in it, nor a wait for a pooled connection: the
    /// PostgreSQL queue takes it before each of its receive statements,
    /// once it holds the connection that sends it, so a message delivered
    /// late in a long poll, or after a wait for the pool, is counted from
    /// its delivery. Amazon SQS waits inside its request (up to 20 s) and
    /// says not when it delivered: there it is when the ReceiveMessage
    /// request that returned the message went out (its attempt that
    /// answered, after the client's retries of earlier ones), and a
    /// delivery made late in that request's wait looks that much shorter.
    pub requested_at: Instant,
}

/// A queue's figures at one moment (approximate under concurrent traffic).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Messages receivable now.
    pub depth: u64,
    /// Received, not deleted, visibility timeout not yet over.
    pub in_flight: u64,
    /// Sent with a delay that has not run out.
    pub delayed: u64,
    /// Age of the oldest message in the queue, any state.
    pub oldest_age: Option<Duration>,
    /// Messages in the dead-letter queue, when there is one.
    pub dead_letter_depth: Option<u64>,
}

/// A queue with SQS semantics (see the module docs for the contract).
///
/// A value names one queue. Every method is cancel-safe in the sense that a
/// dropped call either happened or did not; a dropped receive may have
/// delivered messages nobody will see, which come back after their
/// visibility timeout (the PostgreSQL queue gives such deliveries back at
/// once, but for a window: module docs, "Cancel safety"). To stop a
/// receive without that loss, tell it to stop instead of dropping it:
/// [`Queue::receive_or_stop`].
pub trait Queue: Send + Sync {
    /// The queue's name.
    fn name(&self) -> &str;

    /// True for a FIFO queue.
    fn is_fifo(&self) -> bool;

    /// Sends one message.
    fn send(&self, message: SendMessage) -> impl Future<Output = Result<Sent>> + Send;

    /// Sends several messages; results in input order.
    ///
    /// An error means nothing was sent, but for
    /// [`Error::SendBatchIncomplete`]: a backend that sends the batch in
    /// several requests (SQS: 10 messages each) cannot take back what the
    /// requests before a failure sent, and names in that error the
    /// messages sent, with their ids, and those not known to be sent, to
    /// send again. (The PostgreSQL queue sends the batch in one statement:
    /// all or nothing.)
    fn send_batch(
        &self,
        messages: Vec<SendMessage>,
    ) -> impl Future<Output = Result<Vec<Sent>>> + Send;

    /// Receives up to `request.max_messages` messages, waiting up to
    /// `request.wait` when there are none. May return fewer, or none.
    fn receive(
        &self,
        request: ReceiveRequest,
    ) -> impl Future<Output = Result<Vec<Received>>> + Send;

    /// [`Queue::receive`], told to stop early by `stop`: once `stop`
    /// resolves, a receive that is only waiting for messages to arrive
    /// (long polling, nothing delivered) gives up and returns none, and
    /// one whose request to the server is under way finishes it and
    /// returns what it delivered. Dropping a receive instead may lose
    /// what the server had already delivered (it then waits out its
    /// visibility timeout); a caller that stops this way gets every
    /// delivered message, to handle or to hand back at once
    /// ([`Queue::change_visibility`] to zero).
    ///
    /// A receive whose `stop` has already resolved when it is first
    /// polled asks the server for nothing and returns none: not started,
    /// it has nothing to finish, and a delivery made only to be handed
    /// back would still count toward the message's `max_receive_count`.
    ///
    /// The default cannot tell waiting from a request under way: once
    /// started, it finishes the receive whatever `stop` says, so it
    /// returns within `request.wait` plus one request. Backends that can
    /// tell override it.
    fn receive_or_stop(
        &self,
        request: ReceiveRequest,
        stop: impl Future<Output = ()> + Send,
    ) -> impl Future<Output = Result<Vec<Received>>> + Send {
        async move {
            request.validate()?;
            if stop.now_or_never().is_some() {
                return Ok(Vec::new());
            }
            self.receive(request).await
        }
    }

    /// Deletes the delivered message; [`Error::StaleReceipt`] when the
    /// receipt does not name the message's current delivery in this queue
    /// (redelivered, moved, redriven, purged or deleted since; issued by
    /// another queue; malformed): nothing deleted. [`Error::QueueNotFound`]
    /// when the queue is gone (deleted since the handle was opened; on the
    /// PostgreSQL queue also one of the other kind created under its name
    /// since, which is not the handle's queue): nothing deleted.
    fn delete(&self, receipt: &Receipt) -> impl Future<Output = Result<()>> + Send;

    /// Deletes several delivered messages at once; returns the receipts that
    /// were stale, as [`Queue::delete`] means it (their messages untouched),
    /// in input order. Each receipt is checked against its own delivery:
    /// with two receipts of one message, only the current one deletes. A
    /// receipt given twice is one receipt: both places share its outcome.
    ///
    /// An error means nothing was deleted, but for
    /// [`Error::DeleteBatchIncomplete`]: a backend that sends the batch in
    /// several requests (SQS: 10 receipts each) cannot take back what the
    /// requests before a failure deleted, and names in that error the
    /// receipts found stale and those not known to be deleted; the rest
    /// were deleted. (The PostgreSQL queue deletes the batch in one
    /// statement: all or nothing.) A queue that is gone is
    /// [`Error::QueueNotFound`], as for [`Queue::delete`].
    fn delete_batch(
        &self,
        receipts: &[Receipt],
    ) -> impl Future<Output = Result<Vec<Receipt>>> + Send;

    /// Makes the delivered message invisible for `timeout` from now (zero:
    /// visible at once); [`Error::StaleReceipt`] and
    /// [`Error::QueueNotFound`] as for delete.
    fn change_visibility(
        &self,
        receipt: &Receipt,
        timeout: Duration,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Deletes every message of the queue; returns how many when known.
    /// [`Error::PurgeInProgress`] where the backend takes one purge at a
    /// time (SQS: one per queue per 60 s) and another is under way: this
    /// call deleted nothing. [`Error::QueueNotFound`] when the queue is
    /// gone (as for [`Queue::delete`]): nothing deleted, in a queue of the
    /// other kind created under its name neither.
    fn purge(&self) -> impl Future<Output = Result<u64>> + Send;

    /// The queue's figures; [`Error::QueueNotFound`] when the queue is
    /// gone (as for [`Queue::delete`]).
    fn stats(&self) -> impl Future<Output = Result<QueueStats>> + Send;

    /// Called on a dead-letter queue: moves its messages back to the queues
    /// they came from; returns how many moved. Messages a consumer of the
    /// dead-letter queue has in flight stay. A queue they came from that is
    /// gone is an error, and its messages stay: on the PostgreSQL queue
    /// [`Error::QueueNotFound`] naming it (deleted by hand, or created
    /// again as the other kind; the first by name when several are),
    /// once the messages of the queues that stand have moved back; on SQS
    /// [`Error::Invalid`] when no queue names this one its dead-letter
    /// queue.
    ///
    /// A redriven FIFO message rejoins its group at the back, behind every
    /// message of the group sent before the redrive, as SQS re-sends it: it
    /// waits for the group's message in flight, if any, and for those
    /// queued. The PostgreSQL queue moves a group's dead letters in their
    /// order and stops at the first that stays (in flight here), so a later
    /// redrive cannot put an earlier dead letter behind a later one; the
    /// group's messages that are not dead letters stay and hold nothing
    /// back. It keeps each message's id and
    /// history and gives it a fresh dead-letter count; every receipt from
    /// before the move is stale.
    fn redrive(&self) -> impl Future<Output = Result<u64>> + Send;
}
