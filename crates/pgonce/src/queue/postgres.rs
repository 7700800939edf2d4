//! The PostgreSQL queue: [`Queue`] on the `pgonce.queue_message` table.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt;
use sha2::{Digest, Sha256};
use sqlx::postgres::PgListener;
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use tokio::sync::{Notify, OnceCell};

use super::{
    MAX_BATCH, MAX_BODY_BYTES, MAX_VISIBILITY, Queue, QueueStats, Receipt, ReceiveRequest,
    Received, SendMessage, Sent,
};
use crate::error::{Error, Result};
use crate::listen::Listen;
use crate::lock::LockKey;
use crate::service::{Failure, Failures};
use crate::transaction::{self, IsolationLevel};

mod notifier;
mod visible_timer;
use notifier::Notifier;
use visible_timer::VisibleTimer;

/// The channel every send notifies, with the queue name as payload.
const CHANNEL: &str = "pgonce_queue";

/// How many times a send (one message or a batch) tries before it gives
/// up on a queue that changes under it ([`Error::QueueChangedDuringSend`]).
const SEND_ATTEMPTS: u32 = 3;

/// The longest retention and deduplication window a queue takes.
const MAX_RETENTION: Duration = Duration::from_secs(14 * 24 * 3600);

/// A receive statement: pick (standard or FIFO), judge each picked
/// message's fate, then act on it. The first statement of a receive looks
/// at no more than it may deliver; a follow-up looks further and caps its
/// deliveries (`receive_fate_capped.sql`, one parameter more).
macro_rules! receive_sql {
    ($pick:literal, $fate:literal) => {
        concat!(
            include_str!("sql/receive_head.sql"),
            include_str!($pick),
            include_str!("sql/receive_judge.sql"),
            include_str!($fate),
            include_str!("sql/receive_act.sql"),
            include_str!("sql/receive_deliver.sql"),
            include_str!("sql/receive_report.sql"),
            include_str!("sql/receive_next_visible.sql")
        )
    };
}
/// The first statement of a standard receive: it delivers and decides no
/// other fate (`receive_fate_lean.sql`). A picked message due to expire or
/// to move to the dead-letter queue comes back 'undecided', and the
/// receive looks again with [`RECEIVE_STANDARD_FURTHER`], which decides
/// it. Without the full statement's DELETE and second UPDATE it is
/// cheaper to start, on every receive.
const RECEIVE_STANDARD_LEAN: &str = concat!(
    include_str!("sql/receive_head.sql"),
    include_str!("sql/pick_standard.sql"),
    include_str!("sql/receive_judge.sql"),
    include_str!("sql/receive_fate_lean.sql"),
    include_str!("sql/receive_deliver.sql"),
    include_str!("sql/receive_report_lean.sql"),
    include_str!("sql/receive_next_visible.sql")
);
const RECEIVE_FIFO: &str = receive_sql!("sql/pick_fifo.sql", "sql/receive_fate.sql");
const RECEIVE_STANDARD_FURTHER: &str =
    receive_sql!("sql/pick_standard.sql", "sql/receive_fate_capped.sql");
const RECEIVE_FIFO_FURTHER: &str = receive_sql!("sql/pick_fifo.sql", "sql/receive_fate_capped.sql");

/// Where a message is now and how it got there ([`PgQueue::history`]).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct MessageHistory {
    /// The queue the message is in now: its own, or a dead-letter queue.
    pub queue: String,
    /// Its dead-letter moves and redrives, oldest first: a JSON array of
    /// objects with an `event` (`dead_lettered` or `redriven`), the queues
    /// it left and entered (`from`, `to`) and when (`at`).
    #[sqlx(json)]
    pub history: serde_json::Value,
}

/// A queue's attributes, fixed per queue in `pgonce.queue` by
/// [`PgQueue::create`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueAttributes {
    /// FIFO (message groups, strict order per group) or standard. Default:
    /// standard. Fixed when the queue is created.
    pub fifo: bool,
    /// How long a received message stays invisible. Default 30 s; at most
    /// 12 h.
    pub visibility_timeout: Duration,
    /// Messages older than this are dropped at their next receive. Default
    /// 4 days; at least 1 s, at most 14 days (as in SQS).
    pub retention: Duration,
    /// Delivery delay of every message without one of its own. Default 0;
    /// at most 15 min.
    pub delay: Duration,
    /// After this many receives in this queue (since it was sent, or moved
    /// here by a dead-letter move or a redrive), the next receive moves the
    /// message to `dead_letter_queue`. Default: none. Both or neither must
    /// be set; at most `i32::MAX`.
    pub max_receive_count: Option<u32>,
    /// The dead-letter queue's name; it must exist and be of the same kind
    /// (FIFO or standard), as in SQS. Default: none.
    pub dead_letter_queue: Option<String>,
    /// How long a deduplication id is remembered. Default 5 min; at most 14
    /// days.
    pub dedup_window: Duration,
    /// Use the SHA-256 of the body as deduplication id when a message has
    /// none. Default false.
    pub content_based_dedup: bool,
}

impl Default for QueueAttributes {
    fn default() -> Self {
        QueueAttributes {
            fifo: false,
            visibility_timeout: Duration::from_secs(30),
            retention: Duration::from_secs(4 * 24 * 3600),
            delay: Duration::ZERO,
            max_receive_count: None,
            dead_letter_queue: None,
            dedup_window: Duration::from_secs(5 * 60),
            content_based_dedup: false,
        }
    }
}

impl QueueAttributes {
    /// A FIFO queue with the default attributes.
    pub fn fifo() -> QueueAttributes {
        QueueAttributes {
            fifo: true,
            ..QueueAttributes::default()
        }
    }

    /// Sets the visibility timeout.
    pub fn visibility_timeout(mut self, timeout: Duration) -> Self {
        self.visibility_timeout = timeout;
        self
    }

    /// Sets the dead-letter queue and the receives before moving there.
    pub fn dead_letter(mut self, queue: impl Into<String>, max_receive_count: u32) -> Self {
        self.dead_letter_queue = Some(queue.into());
        self.max_receive_count = Some(max_receive_count);
        self
    }

    /// Sets the deduplication window.
    pub fn dedup_window(mut self, window: Duration) -> Self {
        self.dedup_window = window;
        self
    }

    /// Checks the invariants stated on each field.
    pub fn validate(&self) -> Result<()> {
        let invalid = |why: &str| {
            Err(Error::Invalid {
                what: "queue attributes",
                why: why.into(),
            })
        };
        if self.visibility_timeout > MAX_VISIBILITY {
            return invalid("visibility timeout is at most 12 hours");
        }
        if self.retention < Duration::from_secs(1) {
            return invalid("retention is at least 1 second");
        }
        // SQS's maximum; far longer ones overflow PostgreSQL's timestamps
        // in every receive (`now() - retention`).
        if self.retention > MAX_RETENTION {
            return invalid("retention is at most 14 days");
        }
        if self.dedup_window > MAX_RETENTION {
            return invalid("the deduplication window is at most 14 days");
        }
        if self.delay > Duration::from_secs(15 * 60) {
            return invalid("delay is at most 15 minutes");
        }
        if self.max_receive_count.is_some() != self.dead_letter_queue.is_some() {
            return invalid("set both max_receive_count and dead_letter_queue, or neither");
        }
        if self.max_receive_count == Some(0) {
            return invalid("max_receive_count is at least 1");
        }
        if self
            .max_receive_count
            .is_some_and(|n| i32::try_from(n).is_err())
        {
            return invalid("max_receive_count is at most 2147483647");
        }
        Ok(())
    }
}

/// How a [`PgQueue`] handle behaves (not stored in the database).
#[derive(Debug, Clone)]
pub struct PgQueueOptions {
    /// Notify long-polling receivers (`pg_notify`) on each send, and on
    /// what else makes a message receivable at once: a release (visibility
    /// zero), the delete of a FIFO head with more of its group behind it,
    /// a redrive (which notifies the source queues), a receive that moves
    /// messages to the dead-letter queue (which notifies that queue); and
    /// on a hand-back
    /// that makes a message visible sooner than it was to be (a
    /// visibility change shorter than the time left). Default true.
    /// Without it, long polls find new messages only at `poll_interval`;
    /// with it, every sending transaction takes PostgreSQL's notification
    /// lock at commit.
    pub notify: bool,
    /// A long poll re-checks the queue at least this often, for missed
    /// notifications, for a message that becomes visible later than
    /// its look foresaw (its lease taken after that look, by a receiver
    /// the look could not see), and for a message its look skipped because
    /// another transaction held it locked, which then let go without
    /// taking it and without a word (a receive statement that fails wakes
    /// the parked receivers; one whose connection is lost with its process
    /// cannot). A message a look saw coming (sent with a
    /// delay, in flight, handed back with a delay) wakes one receiver of
    /// the handle family when it becomes visible, whatever this interval,
    /// and that receiver, if it delivered, wakes the next. Default 1 s; at
    /// least 1 ms
    /// (shorter would poll the database in a busy loop), at most
    /// [`MAX_WAIT`](crate::queue::MAX_WAIT) (a wait's longest: a longer
    /// interval never comes round, and each re-check's time, now plus the
    /// interval, must exist).
    pub poll_interval: Duration,
    /// Where long polls listen for sends (see [`Listen`]). Default: a
    /// connection like the pool's.
    pub listen: Listen,
}

impl PgQueueOptions {
    /// Checks the bounds stated on each field.
    fn validate(&self) -> Result<()> {
        crate::duration::check_within(
            "queue options poll_interval",
            self.poll_interval,
            Duration::from_millis(1),
            crate::queue::MAX_WAIT,
        )
    }
}

impl Default for PgQueueOptions {
    fn default() -> Self {
        PgQueueOptions {
            notify: true,
            poll_interval: Duration::from_secs(1),
            listen: Listen::Pool,
        }
    }
}

/// A handle on one named queue in PostgreSQL. Cheap to clone; clones share
/// one LISTEN connection, opened at the first long poll (with
/// [`Listen::Pool`], with the pool's connect options but outside the pool:
/// it takes none of its connections) and kept until the last clone is
/// dropped: count one server connection more per handle family (each
/// `create`/`open` call) that long-polls.
///
/// Receipts read `<queue>:<id>:<generation>` and act only on that
/// generation of that message while it is in that queue (module docs).
///
/// Every statement runs on the pool in its own implicit transaction, except
/// the `*_in` methods, which run in the caller's transaction (transactional
/// enqueue: the message exists, and wakes receivers, only if that
/// transaction commits).
///
/// Those implicit transactions run at the session's default isolation,
/// which the queue's statements are written for at PostgreSQL's own
/// default, READ COMMITTED: a receive skips or re-checks a message another
/// transaction changed since its snapshot. Under a stricter default (`ALTER
/// DATABASE ... SET default_transaction_isolation = 'repeatable read'`, or
/// per role), such a statement fails instead with the retryable
/// [`Error::SerializationFailure`]: nothing is delivered, deleted or
/// changed by it, and the next attempt (the worker's next receive, a
/// retried delete) sees the change. It costs a failed round trip under
/// contention, never a message; wrapping each statement in its own READ
/// COMMITTED transaction would cost two more round trips on every call.
///
/// A handle family lives on one Tokio runtime, as its pool does: its
/// background tasks (the notifier that wakes receivers after a send, the
/// LISTEN relay, the timer for the next message becoming visible) run on
/// the runtime of the first call that needed them, and end when that
/// runtime shuts down. sqlx's pool is bound the same way (its connections'
/// sockets belong to the runtime that opened them), so open the pool and
/// the queue on the runtime that uses them.
#[derive(Clone)]
pub struct PgQueue {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    name: String,
    /// The queue's kind, read when the handle was opened: its statements
    /// act on a queue of this kind only (a queue of the other kind created
    /// under the name since is [`Error::QueueNotFound`] to it).
    fifo: bool,
    /// The queue's content-based deduplication as last read: sends check
    /// it against the queue's row (send.sql), and read it again when it
    /// changed.
    content_based_dedup: AtomicBool,
    options: PgQueueOptions,
    waker: OnceCell<Waker>,
    parked: AtomicUsize,
    /// Notifies after sends that committed on the pool (started by the
    /// first one).
    notifier: std::sync::OnceLock<Notifier>,
}

/// What wakes a handle family's parked receivers: one task turning
/// notifications for this queue into wake-ups (the LISTEN side), and one
/// timer for when the queue's next message becomes visible.
struct Waker {
    notify: Arc<Notify>,
    /// The task relaying notifications; none with [`Listen::Off`].
    task: Option<tokio::task::JoinHandle<()>>,
    /// The family's timer for the next message becoming visible, as its
    /// looks found it (visible_timer.rs).
    visible: VisibleTimer,
}

impl Drop for Waker {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl std::fmt::Debug for PgQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgQueue")
            .field("name", &self.inner.name)
            .field("fifo", &self.inner.fifo)
            .finish()
    }
}

impl PgQueue {
    /// Creates the queue, or updates the attributes of an existing one (its
    /// kind must match: [`Error::Invalid`] otherwise), and returns a handle.
    pub async fn create(
        pool: &PgPool,
        name: &str,
        attributes: QueueAttributes,
        options: PgQueueOptions,
    ) -> Result<PgQueue> {
        attributes.validate()?;
        // Checked by `open` too, but before the queue exists: refused
        // options must not leave a queue created behind an error.
        options.validate()?;
        validate_name(name)?;
        if let Some(dlq) = &attributes.dead_letter_queue {
            validate_name(dlq)?;
            if dlq == name {
                return Err(Error::Invalid {
                    what: "queue attributes",
                    why: "a queue cannot be its own dead-letter queue".into(),
                });
            }
        }
        let fifo: std::result::Result<Option<bool>, sqlx::Error> =
            sqlx::query_scalar(include_str!("sql/create_queue.sql"))
                .bind(name)
                .bind(attributes.fifo)
                .bind(millis(attributes.visibility_timeout))
                .bind(millis(attributes.retention))
                .bind(millis(attributes.delay))
                .bind(attributes.max_receive_count.map(|n| n as i32))
                .bind(&attributes.dead_letter_queue)
                .bind(millis(attributes.dedup_window))
                .bind(attributes.content_based_dedup)
                .fetch_optional(pool)
                .await;
        let created = match fifo {
            Err(e)
                if crate::error::sqlstate_of(&e).as_deref()
                    == Some(crate::error::sqlstate::FOREIGN_KEY_VIOLATION)
                    && attributes.dead_letter_queue.is_some() =>
            {
                return Err(Error::QueueNotFound {
                    name: attributes.dead_letter_queue.clone().unwrap_or_default(),
                });
            }
            other => other?,
        };
        // No row: nothing was written or changed (create_queue.sql). Either
        // the dead-letter queue was missing or of the other kind when the
        // statement looked, or the queue exists as the other kind. Read
        // again only to say which.
        if created.is_none() {
            if let Some(dlq) = &attributes.dead_letter_queue {
                let dlq_fifo: Option<bool> = sqlx::query_scalar(include_str!("sql/queue_fifo.sql"))
                    .bind(dlq)
                    .fetch_optional(pool)
                    .await?;
                match dlq_fifo {
                    None => return Err(Error::QueueNotFound { name: dlq.clone() }),
                    Some(dlq_fifo) if dlq_fifo != attributes.fifo => {
                        return Err(Error::Invalid {
                            what: "queue attributes",
                            why: format!(
                                "the dead-letter queue {dlq:?} must be of the queue's kind \
                                 ({}), as in SQS",
                                if attributes.fifo { "FIFO" } else { "standard" }
                            ),
                        });
                    }
                    Some(_) => {}
                }
            }
            return Err(Error::Invalid {
                what: "queue attributes",
                why: format!("queue {name:?} exists with fifo = {}", !attributes.fifo),
            });
        }
        PgQueue::open(pool, name, options).await
    }

    /// A handle on an existing queue; [`Error::QueueNotFound`] otherwise.
    pub async fn open(pool: &PgPool, name: &str, options: PgQueueOptions) -> Result<PgQueue> {
        options.validate()?;
        let Some(QueueRow {
            fifo,
            content_based_dedup,
        }) = QueueRow::read(pool, name).await?
        else {
            return Err(Error::QueueNotFound { name: name.into() });
        };
        Ok(PgQueue {
            inner: Arc::new(Inner {
                pool: pool.clone(),
                name: name.to_string(),
                fifo,
                content_based_dedup: AtomicBool::new(content_based_dedup),
                options,
                waker: OnceCell::new(),
                parked: AtomicUsize::new(0),
                notifier: std::sync::OnceLock::new(),
            }),
        })
    }

    /// The pool this handle runs on.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// How many receives are parked in a long poll right now (for tests and
    /// metrics).
    pub fn parked_receivers(&self) -> usize {
        self.inner.parked.load(Ordering::SeqCst)
    }

    /// Sends one message inside the caller's transaction: it is enqueued,
    /// and receivers are woken, only if `tx` commits. Its delay and its
    /// deduplication window run from this send, not from the start of
    /// `tx`.
    ///
    /// On a FIFO queue the message's group stays locked until `tx` ends:
    /// other sends to that group wait, so the group's order is its commit
    /// order and a receive never passes over a message still being sent.
    /// Its deduplication id, if any, stays locked as well: another send of
    /// the same id waits to see whether this one commits. Keep such a
    /// transaction short, and send to several groups or ids in one order
    /// everywhere (or in one [`PgQueue::send_batch_in`], which locks them
    /// in a fixed order), or two transactions can deadlock
    /// ([`Error::SerializationFailure`], retryable).
    ///
    /// Under REPEATABLE READ or SERIALIZABLE, a send of a deduplication id
    /// that another transaction claimed after this one's snapshot was
    /// taken (committed while this send waited for the id's lock, or
    /// before) is [`Error::SerializationFailure`], retryable, and sends
    /// nothing: the snapshot cannot see the message the id names, so the
    /// send can neither enqueue the id again nor answer with that
    /// message. The retried transaction sees the claim and gets the
    /// duplicate. A claim the snapshot sees gives the duplicate at once.
    pub async fn send_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        message: SendMessage,
    ) -> Result<Sent> {
        self.send_on(tx, message, Wake::InTransaction).await
    }

    /// Sends several messages inside the caller's transaction, their
    /// delays and deduplication windows running from this send (as
    /// [`PgQueue::send_in`]'s). Its locks, and under REPEATABLE READ or
    /// SERIALIZABLE its answer to an id claimed after the snapshot
    /// ([`Error::SerializationFailure`], nothing sent), are
    /// [`PgQueue::send_in`]'s.
    pub async fn send_batch_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        messages: Vec<SendMessage>,
    ) -> Result<Vec<Sent>> {
        self.send_batch_on(tx, messages, Wake::InTransaction).await
    }

    /// The queue a message is in now and its history of dead-letter moves
    /// and redrives (a JSON array); `None` once it is deleted.
    pub async fn history(&self, id: &str) -> Result<Option<MessageHistory>> {
        let id = parse_id(id)?;
        Ok(sqlx::query_as(include_str!("sql/history.sql"))
            .bind(id)
            .fetch_optional(&self.inner.pool)
            .await?)
    }

    /// Whether the queue deduplicates by content, as this handle last read
    /// it. Read once per attempt at a send, so that the ids it chooses and
    /// the view it asks send.sql to check are the same.
    fn content_based(&self) -> bool {
        self.inner.content_based_dedup.load(Ordering::SeqCst)
    }

    /// The advisory lock keys a send of `messages` takes first, ascending,
    /// once each: their FIFO groups' ([`group_lock_keys`]) and their
    /// deduplication ids' (namespace `pgonce.queue.dedup/<queue>`, key the
    /// id).
    ///
    /// Why a deduplication id has a lock of its own: its claim (send.sql)
    /// is a row, and a claim waits for another transaction's uncommitted
    /// claim of the same id. A batch with deduplication ids sends one
    /// message at a time, so claims taken in the batch's order let two
    /// batches sharing ids wait for each other: a deadlock. With the ids'
    /// locks taken first, in the same ascending order as the groups', a
    /// claim never waits for another sender's: that sender holds the id's
    /// lock, which this one waited for.
    ///
    /// With `content_ids`, a message without an id of its own locks the id
    /// content-based deduplication gives it: for a send under that setting,
    /// and for a batch sent one message at a time whatever the handle knows
    /// of the setting, because the batch takes its locks before the first
    /// send and a send may find the setting changed and need that id (taken
    /// then, out of order, it could deadlock).
    fn send_lock_keys<'a>(
        &self,
        messages: impl Iterator<Item = &'a SendMessage> + Clone,
        content_ids: bool,
    ) -> Result<Vec<i64>> {
        let ids: Vec<Cow<'_, str>> = messages
            .clone()
            .filter_map(|m| dedup_id(m, content_ids))
            .collect();
        self.lock_keys(
            messages.filter_map(|m| m.group_id.as_deref()),
            ids.iter().map(|id| id.as_ref()),
        )
    }

    /// The lock keys of these groups and deduplication ids of this queue,
    /// ascending, once each ([`PgQueue::send_lock_keys`]).
    fn lock_keys<'a>(
        &self,
        groups: impl Iterator<Item = &'a str>,
        dedup_ids: impl Iterator<Item = &'a str>,
    ) -> Result<Vec<i64>> {
        let queue = self.inner.name.as_str();
        let mut keys = group_lock_keys(groups.map(|g| (queue, g)))?;
        for dedup_id in dedup_ids {
            keys.push(LockKey::new(&format!("pgonce.queue.dedup/{queue}"), dedup_id)?.as_i64());
        }
        keys.sort_unstable();
        keys.dedup();
        Ok(keys)
    }

    /// One batch of [`Queue::redrive`], in one transaction: picks up to
    /// [`MAX_BATCH`] dead-lettered messages, takes their FIFO groups' locks
    /// in their source queues, then moves back those still dead-lettered.
    /// Under the group's lock a FIFO message gets a position behind every
    /// message of its group sent before (redrive.sql), so it cannot come
    /// back ahead of one in flight. Returns (picked, moved).
    ///
    /// A dead letter goes back to the queue it came from and to no other:
    /// when that queue was deleted by hand since, or a queue of the other
    /// kind created under its name, its letters stay. The batch adds its
    /// name to `gone` and moves the letters of the sources that stand;
    /// it picks no letter of a source already in `gone`, so those letters
    /// take no place of a batch and the redrive reaches the rest.
    /// A batch of a handle whose own queue was deleted by hand and
    /// created again as the other kind moves nothing and is
    /// [`Error::QueueNotFound`], naming this queue: its letters' sources
    /// are of the new kind, and stand.
    async fn redrive_batch(&self, gone: &mut Vec<String>) -> Result<(usize, u64)> {
        let mut tx = transaction::begin(&self.inner.pool, IsolationLevel::ReadCommitted).await?;
        let picked: Vec<DeadLetterRow> = sqlx::query_as(include_str!("sql/redrive_pick.sql"))
            .bind(&self.inner.name)
            .bind(MAX_BATCH as i64)
            .bind(&*gone)
            .fetch_all(&mut *tx)
            .await?;
        if picked.is_empty() {
            // Nothing to move: a queue that is gone (deleted by hand, its
            // letters with it) or of the other kind now is still not this
            // handle's queue, as a redrive that picked letters says.
            let row = QueueRow::read(&mut *tx, &self.inner.name).await?;
            if row.is_none_or(|row| row.fifo != self.inner.fifo) {
                return Err(Error::QueueNotFound {
                    name: self.inner.name.clone(),
                });
            }
            return Ok((0, 0));
        }
        let mut source_queues: Vec<&str> = picked.iter().map(|m| m.source.as_str()).collect();
        source_queues.sort_unstable();
        source_queues.dedup();
        // This queue too: the sources are judged by the handle's kind,
        // which is only theirs while this queue is still the handle's.
        let mut queues = source_queues.clone();
        queues.push(&self.inner.name);
        queues.sort_unstable();
        queues.dedup();
        // A queue's dead-letter queue is of its kind (create checks it).
        let of_this_kind = |found: &[SourceQueueRow], name: &str| {
            found
                .iter()
                .any(|q| q.name == name && q.fifo == self.inner.fifo)
        };
        // Read a second time when one is missing: a row the first read
        // waited for and found deleted may have been replaced in the same
        // transaction (deleted by hand and created again), which the first
        // read's snapshot, taken before its wait, cannot see and a second
        // statement's can. The rows the first read locked stay locked.
        let mut found: Vec<SourceQueueRow> = Vec::new();
        for _ in 0..2 {
            found = sqlx::query_as(include_str!("sql/redrive_sources.sql"))
                .bind(&queues)
                .fetch_all(&mut *tx)
                .await?;
            if queues.iter().all(|name| of_this_kind(&found, name)) {
                break;
            }
        }
        let of_this_kind = |name: &str| of_this_kind(&found, name);
        // Created again as the other kind since the handle was opened
        // (deleted, its letters went with it: picked is empty then).
        if !of_this_kind(&self.inner.name) {
            return Err(Error::QueueNotFound {
                name: self.inner.name.clone(),
            });
        }
        let n_picked = picked.len();
        gone.extend(
            source_queues
                .into_iter()
                .filter(|name| !of_this_kind(name))
                .map(String::from),
        );
        let picked: Vec<&DeadLetterRow> =
            picked.iter().filter(|m| of_this_kind(&m.source)).collect();
        if picked.is_empty() {
            return Ok((n_picked, 0));
        }
        let keys = group_lock_keys(picked.iter().filter_map(|m| {
            m.group_id
                .as_deref()
                .map(|group| (m.source.as_str(), group))
        }))?;
        if !keys.is_empty() {
            sqlx::query(include_str!("sql/lock_groups.sql"))
                .bind(&keys)
                .execute(&mut *tx)
                .await?;
        }
        let ids: Vec<i64> = picked.iter().map(|m| m.id).collect();
        let sources: Vec<&str> = picked.iter().map(|m| m.source.as_str()).collect();
        let moved = sqlx::query(include_str!("sql/redrive.sql"))
            .bind(&self.inner.name)
            .bind(&ids)
            .bind(&sources)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        if moved > 0 && self.inner.options.notify {
            // Receivable in their source queues now: wake the receivers
            // parked there, as a send would.
            let mut sources: Vec<&str> = picked.iter().map(|m| m.source.as_str()).collect();
            sources.sort_unstable();
            sources.dedup();
            self.notify_queues(sources).await;
        }
        Ok((n_picked, moved))
    }

    /// Whether the send statements notify (inside the transaction), per
    /// the handle's options and `wake`.
    fn notify_in_statement(&self, wake: Wake) -> bool {
        self.inner.options.notify && wake == Wake::InTransaction
    }

    /// After a send found no queue to send to under what this handle knows
    /// of it: [`Error::QueueNotFound`] if the queue is gone (or one of the
    /// other kind stands under its name: it was deleted by hand and another
    /// created), else its content-based deduplication read again for the
    /// next attempt.
    async fn read_again(&self, conn: &mut PgConnection) -> Result<()> {
        let Some(row) = QueueRow::read(conn, &self.inner.name)
            .await?
            .filter(|row| row.fifo == self.inner.fifo)
        else {
            return Err(Error::QueueNotFound {
                name: self.inner.name.clone(),
            });
        };
        self.inner
            .content_based_dedup
            .store(row.content_based_dedup, Ordering::SeqCst);
        Ok(())
    }

    /// A send statement's result: `None` to read the queue again and
    /// send again (on the pool only, [`Wake::AfterCommit`]), else its rows
    /// or its error.
    ///
    /// A foreign key's violation, which only the queue's deletion gives a
    /// send statement (by hand, committed while the statement waited for
    /// the queue's row: it found the queue, and its insert then found
    /// none), is [`Error::QueueNotFound`] inside the caller's transaction,
    /// which the failure ended. On the pool the statement failed alone,
    /// and the queue is read again ([`Self::read_again`]): gone, or of the
    /// other kind, it is not found; deleted and created again as its kind
    /// in one transaction, never missing to anyone, the send goes to it.
    fn send_result<T>(&self, result: sqlx::Result<T>, wake: Wake) -> Result<Option<T>> {
        match result {
            Ok(rows) => Ok(Some(rows)),
            Err(e)
                if crate::error::sqlstate_of(&e).as_deref()
                    == Some(crate::error::sqlstate::FOREIGN_KEY_VIOLATION) =>
            {
                if wake == Wake::AfterCommit {
                    return Ok(None);
                }
                Err(Error::QueueNotFound {
                    name: self.inner.name.clone(),
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// After a send committed on the pool: wakes the receivers (notifier.rs).
    fn sent(&self) {
        if self.inner.options.notify {
            self.inner
                .notifier
                .get_or_init(|| Notifier::start(self.inner.pool.clone(), self.inner.name.clone()))
                .sent();
        }
    }

    async fn send_on(
        &self,
        conn: &mut PgConnection,
        message: SendMessage,
        wake: Wake,
    ) -> Result<Sent> {
        message.validate(self.inner.fifo)?;
        // No row: a dedup claim committed by a concurrent sender after this
        // statement's snapshot (the next attempt sees it), or the queue's
        // content-based deduplication changed since this handle read it
        // (the next attempt sends under the queue's).
        for _ in 0..SEND_ATTEMPTS {
            let content_based = self.content_based();
            // The body's digest is taken once, for the id and its lock.
            let dedup_id = dedup_id(&message, content_based);
            let locks = self.lock_keys(
                message.group_id.as_deref().into_iter(),
                dedup_id.as_deref().into_iter(),
            )?;
            let by_content = message.dedup_id.is_none().then_some(content_based);
            let row: sqlx::Result<Option<SentRow>> = sqlx::query_as(include_str!("sql/send.sql"))
                .bind(&self.inner.name)
                .bind(&message.body)
                .bind(Json(&message.attributes))
                .bind(&message.group_id)
                .bind(dedup_id.as_deref())
                .bind(message.delay.map(millis))
                .bind(self.notify_in_statement(wake))
                .bind(&locks)
                .bind(by_content)
                .bind(self.inner.fifo)
                .fetch_optional(&mut *conn)
                .await;
            if let Some(SentRow { id, duplicate }) = self.send_result(row, wake)?.flatten() {
                if duplicate {
                    tracing::debug!(queue = %self.inner.name, id, "duplicate send ignored");
                    metrics::counter!("pgonce_queue_duplicates_total", "queue" => self.inner.name.clone())
                        .increment(1);
                } else {
                    metrics::counter!("pgonce_queue_sent_total", "queue" => self.inner.name.clone())
                        .increment(1);
                }
                return Ok(Sent {
                    id: id.to_string(),
                    duplicate,
                });
            }
            self.read_again(&mut *conn).await?;
        }
        Err(self.changed_during_send())
    }

    /// What a send answers when the queue changed under every attempt.
    fn changed_during_send(&self) -> Error {
        Error::QueueChangedDuringSend {
            queue: self.inner.name.clone(),
            attempts: SEND_ATTEMPTS,
        }
    }

    async fn send_batch_on(
        &self,
        conn: &mut PgConnection,
        messages: Vec<SendMessage>,
        wake: Wake,
    ) -> Result<Vec<Sent>> {
        if messages.is_empty() || messages.len() > MAX_BATCH {
            return Err(Error::Invalid {
                what: "batch",
                why: format!("a batch holds 1 to {MAX_BATCH} messages"),
            });
        }
        for m in &messages {
            m.validate(self.inner.fifo)?;
        }
        let total: usize = messages.iter().map(SendMessage::size).sum();
        if total > MAX_BODY_BYTES * 16 {
            return Err(Error::MessageTooLarge {
                size: total,
                max: MAX_BODY_BYTES * 16,
            });
        }
        // Nothing sent by an attempt: the queue is gone, or it changed its
        // content-based deduplication since this handle read it, and the
        // next attempt sends under the queue's (capped as `send_on`).
        for _ in 0..SEND_ATTEMPTS {
            if let Some(sent) = self.send_batch_attempt(conn, &messages, wake).await? {
                return Ok(sent);
            }
            self.read_again(&mut *conn).await?;
        }
        Err(self.changed_during_send())
    }

    /// One attempt at a batch, under the queue's content-based
    /// deduplication as this handle last read it; `None` when the queue
    /// refused that setting and nothing was sent.
    async fn send_batch_attempt(
        &self,
        conn: &mut PgConnection,
        messages: &[SendMessage],
        wake: Wake,
    ) -> Result<Option<Vec<Sent>>> {
        let content_based = self.content_based();
        if content_based || messages.iter().any(|m| m.dedup_id.is_some()) {
            // One statement, not a savepoint around a send per message: a
            // savepoint begun on the caller's transaction (sqlx's nested
            // `begin`) that is given up or fails before it is taken rolls
            // back the caller's whole transaction, and the caller's
            // `commit` then reports success having written nothing.
            return self
                .send_batch_deduplicated(conn, messages, content_based, wake)
                .await;
        }
        let locks = self.send_lock_keys(messages.iter(), false)?;
        let columns = BatchColumns::of(messages);
        let n = messages.len();
        let ids: sqlx::Result<Vec<i64>> = sqlx::query_scalar(include_str!("sql/send_batch.sql"))
            .bind(&self.inner.name)
            .bind(columns.bodies)
            .bind(columns.attributes)
            .bind(columns.groups)
            .bind(columns.delays)
            .bind(self.notify_in_statement(wake))
            .bind(&locks)
            .bind(self.inner.fifo)
            .fetch_all(&mut *conn)
            .await;
        let Some(ids) = self.send_result(ids, wake)? else {
            return Ok(None);
        };
        if ids.len() != n {
            // Nothing was sent (send_batch.sql is all or none): the queue
            // is gone, or it deduplicates by content now, and the messages
            // go under the ids of their bodies (send_batch_dedup.sql).
            return Ok(None);
        }
        metrics::counter!("pgonce_queue_sent_total", "queue" => self.inner.name.clone())
            .increment(n as u64);
        Ok(Some(
            ids.into_iter()
                .map(|id| Sent {
                    id: id.to_string(),
                    duplicate: false,
                })
                .collect(),
        ))
    }

    /// A batch with deduplication ids (given, or drawn from the bodies on
    /// a queue that deduplicates by content), in one statement
    /// (`sql/send_batch_dedup.sql`): all or none, with nothing left for
    /// the client to undo if the call is given up mid-way, and one round
    /// trip. `None`: nothing was sent (the queue is gone, or its
    /// content-based deduplication changed), to read again and send again
    /// under the queue's.
    async fn send_batch_deduplicated(
        &self,
        conn: &mut PgConnection,
        messages: &[SendMessage],
        content_based: bool,
        wake: Wake,
    ) -> Result<Option<Vec<Sent>>> {
        // The bodies' digests are taken once, for the ids and their locks.
        let dedup_ids: Vec<Option<Cow<'_, str>>> = messages
            .iter()
            .map(|m| dedup_id(m, content_based))
            .collect();
        let locks = self.lock_keys(
            messages.iter().filter_map(|m| m.group_id.as_deref()),
            dedup_ids.iter().flatten().map(|id| id.as_ref()),
        )?;
        let columns = BatchColumns::of(messages);
        let ids: Vec<Option<&str>> = dedup_ids.iter().map(|d| d.as_deref()).collect();
        let by_content: Vec<Option<bool>> = messages
            .iter()
            .map(|m| m.dedup_id.is_none().then_some(content_based))
            .collect();
        let rows: sqlx::Result<Vec<SentRow>> =
            sqlx::query_as(include_str!("sql/send_batch_dedup.sql"))
                .bind(&self.inner.name)
                .bind(columns.bodies)
                .bind(columns.attributes)
                .bind(columns.groups)
                .bind(ids)
                .bind(columns.delays)
                .bind(self.notify_in_statement(wake))
                .bind(&locks)
                .bind(by_content)
                .bind(self.inner.fifo)
                .fetch_all(&mut *conn)
                .await;
        let Some(rows) = self.send_result(rows, wake)? else {
            return Ok(None);
        };
        if rows.len() != messages.len() {
            return Ok(None);
        }
        let duplicates = rows.iter().filter(|r| r.duplicate).count();
        tracing::debug!(queue = %self.inner.name, duplicates, "deduplicated batch sent");
        metrics::counter!("pgonce_queue_duplicates_total", "queue" => self.inner.name.clone())
            .increment(duplicates as u64);
        metrics::counter!("pgonce_queue_sent_total", "queue" => self.inner.name.clone())
            .increment((rows.len() - duplicates) as u64);
        Ok(Some(
            rows.into_iter()
                .map(|SentRow { id, duplicate }| Sent {
                    id: id.to_string(),
                    duplicate,
                })
                .collect(),
        ))
    }

    /// One receive, no waiting: one receive statement, its own transaction.
    ///
    /// A statement can pick messages it does not deliver: heads past their
    /// retention (deleted), received too often (moved to the dead-letter
    /// queue), due to move while a sender holds their group there (held
    /// back, receive_report.sql), or, in a standard queue, committed between
    /// the statement's snapshot and its pick's (unseen: locked, not acted
    /// on; migration 0160). While the batch has room and the last
    /// statement picked such messages, further statements look again,
    /// passing over every message held back or delivered so far (`$4`) and
    /// looking twice as far each time (`$2`; deliveries stay capped by the
    /// room left, `$5`): a run of such heads costs a few statements, not
    /// one each, and takes no place of the batch. The follow-ups look at
    /// [`MAX_BATCH`] messages in all at most, so a receive of one does no
    /// more work than a receive of the largest batch (a backlog of expired
    /// messages is cleared a batch at a time; a long poll goes on at once).
    /// A statement that left receivable messages untouched (past its cap)
    /// held their row locks while it ran, turning other receivers away: it
    /// wakes them, as a send does. A held-back message wakes nobody: it is
    /// looked at again at the next poll after its sender commits. Each
    /// statement commits on its own, so if a later one fails after earlier
    /// ones delivered, those leases are taken: they are returned and the
    /// failure logged. The dead-letter queues earlier statements moved
    /// messages to are woken, whether the receive returns or fails.
    ///
    /// The statements run on one pooled connection
    /// ([`transaction::answered_or_given_back`]): a receive dropped by its
    /// caller once a statement was sent (which the server runs regardless)
    /// hands its look to a task, which finishes it and gives what it
    /// delivered back ([`Self::give_back`]) before that connection serves
    /// anyone else.
    async fn receive_once(&self, request: &ReceiveRequest) -> Result<Vec<Received>> {
        Ok(self.receive_looking(request).await?.received)
    }

    /// [`Self::receive_once`], with what a long poll needs to know to wait
    /// ([`Look`]).
    async fn receive_looking(&self, request: &ReceiveRequest) -> Result<Look> {
        let (looking, giving_back) = (self.clone(), self.clone());
        let request = *request;
        let look = transaction::answered_or_given_back(
            &self.inner.pool,
            move |conn| Box::pin(async move { looking.look_on(conn, &request).await }),
            move |conn, look| Box::pin(async move { giving_back.give_back(conn, &look).await }),
        )
        .await?;
        Ok(look)
    }

    /// One look of a receive ([`Self::receive_looking`]), its statements
    /// run on `conn`.
    async fn look_on(&self, conn: &mut PgConnection, request: &ReceiveRequest) -> Result<Look> {
        let max = request.max_messages;
        let mut found = Look::default();
        let mut look = max;
        let mut looked_further = 0;
        let mut undelivered = self
            .receive_statement(conn, request, look, Statement::First, &mut found)
            .await?;
        let mut failed = None;
        while undelivered && found.received.len() < max && looked_further < MAX_BATCH {
            look = (look * 2).min(MAX_BATCH - looked_further);
            looked_further += look;
            let room = max - found.received.len();
            match self
                .receive_statement(
                    conn,
                    request,
                    look,
                    Statement::FollowUp { room },
                    &mut found,
                )
                .await
            {
                Ok(more) => undelivered = more,
                Err(e) if found.received.is_empty() => {
                    failed = Some(e);
                    break;
                }
                Err(e) => {
                    tracing::warn!(queue = %self.inner.name, error = %e, delivered = found.received.len(), "a receive's follow-up statement failed; returning what it delivered");
                    break;
                }
            }
        }
        // Each statement committed its moves: those messages wait in the
        // dead-letter queues now, whatever comes of the look (it fails,
        // or its caller is gone and it is given back).
        self.wake_dead_letter_queues(std::mem::take(&mut found.dead_letter_queues));
        if let Some(e) = failed {
            return Err(e);
        }
        let received = &mut found.received;
        if !received.is_empty() {
            // SQL order is not guaranteed through UNION ALL; FIFO callers
            // rely on id order, so restore it.
            received.sort_by_key(|r| r.id.parse::<i64>().unwrap_or(0));
            metrics::counter!("pgonce_queue_received_total", "queue" => self.inner.name.clone())
                .increment(received.len() as u64);
        } else {
            // As SQS's NumberOfEmptyReceives: receivers looking more often
            // than messages arrive.
            metrics::counter!("pgonce_queue_empty_receives_total", "queue" => self.inner.name.clone())
                .increment(1);
        }
        found.more = undelivered && found.received.len() < max && looked_further >= MAX_BATCH;
        Ok(found)
    }

    /// One receive statement, on `conn`: looks at up to `look` messages
    /// other than `found.passed_over` and delivers at most `look`, or
    /// `room` for a follow-up; appends its deliveries to `found.received`,
    /// the ids it delivered or held back to `found.passed_over`, and the
    /// dead-letter queues it moved messages to to
    /// `found.dead_letter_queues`; when it delivered nothing and a message
    /// of the queue becomes visible later, sets `found.next_visible` to
    /// when (by this process's clock, no earlier than the server's time).
    /// True when it picked messages it did not deliver (held back, moved
    /// or expired, or left undecided by the lean first statement), so that
    /// looking further may find more.
    ///
    /// A follow-up always runs the full statement, even when it looks at
    /// no more messages than it may deliver (a receive of the largest
    /// batch, whose follow-ups may look no further than its first
    /// statement did): the lean statement decides no expiry and no move,
    /// so run again it would leave the same messages undecided, and the
    /// receive would end without deciding them, at every attempt.
    async fn receive_statement(
        &self,
        conn: &mut PgConnection,
        request: &ReceiveRequest,
        look: usize,
        statement: Statement,
        found: &mut Look,
    ) -> Result<bool> {
        let Look {
            received,
            passed_over,
            next_visible,
            dead_letter_queues,
            ..
        } = found;
        let sql = match (self.inner.fifo, statement) {
            (false, Statement::First) => RECEIVE_STANDARD_LEAN,
            (true, Statement::First) => RECEIVE_FIFO,
            (false, Statement::FollowUp { .. }) => RECEIVE_STANDARD_FURTHER,
            (true, Statement::FollowUp { .. }) => RECEIVE_FIFO_FURTHER,
        };
        let mut query = sqlx::query_as(sql)
            .bind(&self.inner.name)
            .bind(look as i64)
            .bind(request.visibility.map(millis))
            .bind(&*passed_over);
        if let Statement::FollowUp { room } = statement {
            query = query.bind(room as i64);
        }
        // The connection is held already: a wait for the pool is no part
        // of the delivery, and counted in it would end the worker's
        // heartbeat that much early.
        // Its deliveries' visibility is counted from the statement's start
        // (`now()`, in its own transaction), after this: their stated end
        // is never past the real one. Taken here, not at the receive's
        // start, so a long poll's wait before this look is not counted.
        let requested_at = Instant::now();
        let rows: Vec<ReceiveRow> = match query.fetch_all(&mut *conn).await {
            Ok(rows) => rows,
            Err(e) => {
                // The statement may have locked messages before it failed
                // (its pick, FOR UPDATE SKIP LOCKED): receivers that looked
                // meanwhile skipped them, found nothing and, those being
                // visible to their snapshots, no time to wake at. Rolled
                // back, they are receivable now: wake them, as a send
                // would. Only here, never on a receive that succeeded.
                self.sent();
                return Err(e.into());
            }
        };
        // The server counted the wait from its `now()`, before the rows came
        // back: a wake counted from here is never early.
        let answered_at = Instant::now();
        let (mut dead, mut expired, mut skipped, mut unseen) = (0u64, 0u64, 0u64, 0u64);
        let mut undecided = 0u64;
        let mut held = Vec::new();
        let mut no_queue = false;
        for row in rows {
            match row.fate.as_str() {
                "delivered" => {
                    passed_over.push(row.id);
                    received.push(Received {
                        id: row.id.to_string(),
                        receipt: ReceiptParts {
                            queue: &self.inner.name,
                            id: row.id,
                            generation: row.generation.unwrap_or(0),
                        }
                        .receipt(),
                        body: row.body.unwrap_or_default(),
                        attributes: row.attributes.map(|Json(a)| a).unwrap_or_default(),
                        group_id: row.group_id,
                        receive_count: row.receive_count.unwrap_or(1) as u32,
                        sent_at: row
                            .sent_at
                            .map(std::time::SystemTime::from)
                            .unwrap_or(std::time::UNIX_EPOCH),
                        visibility: row
                            .visibility_ms
                            .map(|ms| Duration::from_millis(ms.max(0) as u64)),
                        requested_at,
                    });
                }
                "dead_lettered" => {
                    dead += 1;
                    dead_letter_queues.extend(row.dead_letter_queue);
                }
                "held" => held.push(row.id),
                "skipped" => skipped += 1,
                "unseen" => unseen += 1,
                "undecided" => undecided += 1,
                "no_queue" => no_queue = true,
                "next_visible" => {
                    *next_visible = row.next_visible_ms.map(|ms| {
                        answered_at + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
                    });
                }
                _ => expired += 1,
            }
        }
        let name = &self.inner.name;
        if no_queue {
            // Nothing was delivered, moved or deleted: the statement found
            // no queue to act for.
            return Err(Error::QueueNotFound { name: name.clone() });
        }
        if dead > 0 {
            tracing::warn!(queue = %name, dead, "messages moved to the dead-letter queue");
            metrics::counter!("pgonce_queue_dead_lettered_total", "queue" => name.clone())
                .increment(dead);
            dead_letter_queues.sort_unstable();
            dead_letter_queues.dedup();
        }
        if expired > 0 {
            metrics::counter!("pgonce_queue_expired_total", "queue" => name.clone())
                .increment(expired);
        }
        if !held.is_empty() {
            tracing::debug!(queue = %name, ?held, "due to move, their dead-letter group held by a sender: left for a later receive");
            metrics::counter!("pgonce_queue_held_back_total", "queue" => name.clone())
                .increment(held.len() as u64);
        }
        if skipped > 0 || unseen > 0 {
            // Their row locks turned concurrent receivers away until now.
            // Not for a held-back message: nobody can take it before the
            // sender holding its group commits, so a wake would only send
            // receivers (this one among them) to find it held again, for
            // as long as that transaction stays open. It waits for a poll.
            self.sent();
        }
        // An unseen message is receivable now that this statement is over:
        // looking again finds it.
        // An undecided message (the lean first statement's) is due to
        // expire or to move: the next statement, a full one, decides it.
        let undelivered =
            !held.is_empty() || dead > 0 || expired > 0 || unseen > 0 || undecided > 0;
        passed_over.extend(held);
        Ok(undelivered)
    }

    /// Gives back, on `conn`, what `look` delivered for a caller that
    /// stopped waiting for it (receive_given_back.sql): each message still
    /// in that delivery is receivable at once, its receive not counted,
    /// and the parked receivers are woken for it, as a hand-back to zero
    /// wakes them. Counted in `pgonce_queue_deliveries_given_back_total`. A
    /// failure is logged: those messages wait out their visibility
    /// timeout, as they did before there was a give-back.
    async fn give_back(&self, conn: &mut PgConnection, look: &Look) {
        let deliveries: Vec<ReceiptParts<'_>> = look
            .received
            .iter()
            .filter_map(|r| self.receipt_parts(&r.receipt))
            .collect();
        if deliveries.is_empty() {
            return;
        }
        let ids: Vec<i64> = deliveries.iter().map(|d| d.id).collect();
        let generations: Vec<i64> = deliveries.iter().map(|d| d.generation).collect();
        let back: sqlx::Result<Vec<i64>> =
            sqlx::query_scalar(include_str!("sql/receive_given_back.sql"))
                .bind(&self.inner.name)
                .bind(&ids)
                .bind(&generations)
                .fetch_all(&mut *conn)
                .await;
        let name = &self.inner.name;
        match back {
            Ok(back) if back.is_empty() => {}
            Ok(back) => {
                metrics::counter!("pgonce_queue_deliveries_given_back_total", "queue" => name.clone())
                    .increment(back.len() as u64);
                tracing::debug!(queue = %name, ids = ?back, "deliveries given back: their receiver stopped waiting");
                self.sent();
            }
            Err(e) => tracing::warn!(
                queue = %name,
                ?ids,
                error = %e,
                "deliveries made for a receiver that stopped waiting not given back: \
                 the messages wait out their visibility timeout"
            ),
        }
    }

    /// After a receive's look moved messages to the dead-letter queues
    /// `queues` (committed: each receive statement is its own
    /// transaction), once its connection is back in the pool: they
    /// are receivable there now, so the receivers parked on them are woken,
    /// as a send would wake them. The queues are those the statement moved
    /// to (receive_act.sql), not the queue's row read again: the row's
    /// redrive policy may have changed since the commit, to another
    /// dead-letter queue or to none, and the messages wait in the one they
    /// went to.
    ///
    /// From a task of its own, which takes a connection of its own (the
    /// look's, still held, could be the pool's last), and which a receive
    /// dropped after its look answered does not stop: awaited by the
    /// receive, such a drop would lose what the look delivered. Moves are
    /// rare (a message past its receive count), so is the task.
    fn wake_dead_letter_queues(&self, queues: Vec<String>) {
        if self.inner.options.notify && !queues.is_empty() {
            let waking = self.clone();
            tokio::spawn(async move {
                waking
                    .notify_queues(queues.iter().map(String::as_str))
                    .await
            });
        }
    }

    /// Wakes the receivers parked on each of `queues`, each notification
    /// in a transaction of its own (notify.sql), after what made messages
    /// receivable there committed. A notification not sent is logged, not
    /// returned: what committed stands, and those receivers find the
    /// messages at their poll.
    async fn notify_queues(&self, queues: impl IntoIterator<Item = &str>) {
        for queue in queues {
            if let Err(e) = sqlx::query(include_str!("sql/notify.sql"))
                .bind(CHANNEL)
                .bind(queue)
                .execute(&self.inner.pool)
                .await
            {
                tracing::warn!(queue = %queue, error = %e, "notification not sent; the queue's receivers look at their poll");
            }
        }
    }

    /// Deletes these deliveries of a FIFO queue by (id, generation) and
    /// wakes parked receivers when a deleted message's group goes on: its
    /// next message is the group's head, receivable now.
    async fn delete_fifo(&self, ids: &[i64], generations: &[i64]) -> Result<Vec<DeletedRow>> {
        let deleted: Vec<DeletedRow> = sqlx::query_as(include_str!("sql/delete_fifo.sql"))
            .bind(&self.inner.name)
            .bind(ids)
            .bind(generations)
            .fetch_all(&self.inner.pool)
            .await?;
        if deleted.iter().any(|d| d.group_goes_on) {
            self.sent();
        }
        Ok(deleted)
    }

    async fn waker(&self) -> Result<&Waker> {
        self.inner
            .waker
            .get_or_try_init(|| async {
                let notify = Arc::new(Notify::new());
                let Some(listener) = self
                    .inner
                    .options
                    .listen
                    .listener(&self.inner.pool, CHANNEL)
                    .await?
                else {
                    return Ok::<_, Error>(Waker {
                        notify,
                        task: None,
                        visible: VisibleTimer::start(),
                    });
                };
                let task = tokio::spawn(listen(
                    listener,
                    Relisten {
                        listen: self.inner.options.listen.clone(),
                        pool: self.inner.pool.clone(),
                    },
                    self.inner.name.clone(),
                    notify.clone(),
                ));
                Ok(Waker {
                    notify,
                    task: Some(task),
                    visible: VisibleTimer::start(),
                })
            })
            .await
    }

    /// Logs and counts stale receipts; the error for the first.
    fn count_stale(&self, receipt: &Receipt, n: u64) -> Error {
        tracing::warn!(queue = %self.inner.name, %receipt, n, "stale receipt: redelivered, moved or deleted since, or not issued by this queue");
        metrics::counter!("pgonce_queue_stale_receipts_total", "queue" => self.inner.name.clone())
            .increment(n);
        Error::StaleReceipt {
            receipt: receipt.0.clone(),
        }
    }

    /// What a delete or visibility change that acted on nothing answers:
    /// [`Error::QueueNotFound`] when the handle's queue is gone (deleted by
    /// hand, or created again as the other kind, which is not its queue),
    /// as SQS answers a queue deleted since (`QueueDoesNotExist`); else the
    /// receipt was stale ([`Self::count_stale`]). `Err`: the queue's row
    /// could not be read (the call acted on nothing).
    async fn stale_or_gone(&self, receipt: &Receipt, n: u64) -> Result<Error> {
        let row = QueueRow::read(&self.inner.pool, &self.inner.name).await?;
        Ok(if row.is_none_or(|row| row.fifo != self.inner.fifo) {
            self.not_found()
        } else {
            self.count_stale(receipt, n)
        })
    }

    /// [`Error::QueueNotFound`], naming this handle's queue.
    fn not_found(&self) -> Error {
        Error::QueueNotFound {
            name: self.inner.name.clone(),
        }
    }

    /// The delivery `receipt` names, when it is a receipt this queue
    /// issued; `None` (refused as stale) for another queue's or a
    /// malformed one.
    fn receipt_parts<'a>(&self, receipt: &'a Receipt) -> Option<ReceiptParts<'a>> {
        ReceiptParts::parse(&receipt.0).filter(|p| p.queue == self.inner.name)
    }
}

/// Relays this queue's notifications to parked receivers. `try_recv`, not
/// `recv`: when the connection dies, `try_recv` reconnects and LISTENs
/// again before it returns `Ok(None)`, where `recv` would go back to
/// waiting without a word. Notifications committed while nobody listened
/// are lost, and a receiver parked on one of them would sleep until its
/// poll interval; woken once the listener is back, every look it makes
/// sees what was sent meanwhile.
///
/// When that reconnect fails (`Err`: the server down for longer than the
/// pool's acquire timeout, the login refused), the receivers are woken at
/// once, but what is sent after that wake and before a listener is back
/// is lost as well. The next `try_recv` would reconnect without a word, so
/// the relay does not call it until it has a listener again: it builds a
/// new one the way the first was built ([`Relisten`]), which returns only
/// once its LISTEN has run, and wakes the receivers then.
async fn listen(mut listener: PgListener, relisten: Relisten, queue: String, notify: Arc<Notify>) {
    loop {
        match listener.try_recv().await {
            // One receiver wakes per notification; one that fills its
            // batch wakes the next (see `receive`). Waking every receiver
            // of the family sent all of them to look for what one
            // notification announced, and all but one found nothing.
            Ok(Some(n)) if n.payload() == queue => notify.notify_one(),
            Ok(Some(_)) => {}
            Ok(None) => {
                tracing::warn!(queue = %queue, "queue listener reconnected after losing its connection");
                notify.notify_waiters();
            }
            Err(e) => {
                // Notifications sent meanwhile are lost, so wake everyone
                // to look.
                tracing::warn!(queue = %queue, error = %e, "queue listener lost its connection");
                notify.notify_waiters();
                // The old listener goes first: one without a connection
                // holds nothing, and one that still has one (an error
                // other than a lost connection) gives it back to its pool
                // after UNLISTEN.
                drop(listener);
                listener = relisten.until_listening(&queue, &notify).await;
                notify.notify_waiters();
            }
        }
    }
}

/// How the relay builds a new listener after its old one failed: the
/// queue's [`Listen`](crate::Listen) setting and pool.
struct Relisten {
    listen: crate::Listen,
    pool: PgPool,
}

impl Relisten {
    /// A new listener LISTENing on the queues' channel, trying every
    /// half second until one is. Every failed try wakes the receivers as
    /// the first failure did: what was sent meanwhile has nobody to
    /// announce it. Each failed try counts in
    /// `pgonce_queue_listener_failed_tries_total{queue}`; the log has the
    /// first at warn with its error, then a warn line a minute at most
    /// while they go on, and one info line once it listens again, as
    /// [`crate::service`] tells of failed passes (its module docs).
    async fn until_listening(&self, queue: &str, notify: &Notify) -> PgListener {
        let mut failing = Failures::default();
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            match self.listen.listener(&self.pool, CHANNEL).await {
                Ok(Some(listener)) => {
                    match failing.succeeded() {
                        Some(run) => {
                            tracing::info!(queue = %queue, failed = run.count, since = %run.since,
                            "queue listener listening again after {} failed tries since {}", run.count, run.since)
                        }
                        None => tracing::info!(queue = %queue, "queue listener listening again"),
                    }
                    return listener;
                }
                // The relay runs only for a setting that listens.
                Ok(None) => std::future::pending::<()>().await,
                Err(e) => {
                    metrics::counter!("pgonce_queue_listener_failed_tries_total", "queue" => queue.to_owned())
                        .increment(1);
                    match failing
                        .failed(tokio::time::Instant::now(), time::OffsetDateTime::now_utc())
                    {
                        Failure::First => {
                            tracing::warn!(queue = %queue, error = %e,
                            "queue listener cannot listen again yet; retrying")
                        }
                        Failure::StillFailing(run) => {
                            tracing::warn!(queue = %queue,
                            failed = run.count, since = %run.since, error = %e,
                            "queue listener still cannot listen again: {} tries failed since {}; retrying",
                            run.count, run.since)
                        }
                        Failure::Quiet => {
                            tracing::debug!(queue = %queue, error = %e,
                            "queue listener cannot listen again yet; retrying")
                        }
                    }
                    notify.notify_waiters();
                }
            }
        }
    }
}

impl Queue for PgQueue {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn is_fifo(&self) -> bool {
        self.inner.fifo
    }

    async fn send(&self, message: SendMessage) -> Result<Sent> {
        let mut conn = self.inner.pool.acquire().await?;
        let sent = self.send_on(&mut conn, message, Wake::AfterCommit).await?;
        if !sent.duplicate {
            self.sent();
        }
        Ok(sent)
    }

    async fn send_batch(&self, messages: Vec<SendMessage>) -> Result<Vec<Sent>> {
        let mut conn = self.inner.pool.acquire().await?;
        let sent = self
            .send_batch_on(&mut conn, messages, Wake::AfterCommit)
            .await?;
        if sent.iter().any(|s| !s.duplicate) {
            self.sent();
        }
        Ok(sent)
    }

    /// Long polling: the handle LISTENs (one connection per handle family)
    /// and each send NOTIFYs (as do releases, FIFO heads' deletes,
    /// redrives and shortening hand-backs: [`PgQueueOptions::notify`]); a
    /// parked receive wakes on a notification for this queue, when the
    /// queue's next message becomes visible (a delay, a lease or a
    /// hand-back running out, as the family's looks found it), at
    /// `poll_interval`, or at the end of `wait`, whichever comes first. No
    /// connection is held while parked. A notification wakes one receiver
    /// of the family, and a receive that fills its batch wakes the next, so
    /// a burst reaches as many receivers as it needs and a single message
    /// does not send the whole family looking. A message becoming visible
    /// wakes one receiver of the family too (the family keeps one timer,
    /// for the earliest such time its looks found), and that receiver, if
    /// it delivered, wakes the next, which looks for what comes after. A
    /// woken receive dropped or failing before it has looked wakes another
    /// in its place.
    ///
    /// A receive of a queue deleted since the handle was opened (by hand:
    /// pgonce deletes no queue) is [`Error::QueueNotFound`]; a long poll
    /// parked on it when it went says so at its next look. So is one, and
    /// a send, when a queue of the other kind (FIFO or standard) was
    /// created under its name since: the handle's statements are of its
    /// queue's kind, and would break the other's rules. So are the
    /// handle's `delete`, `delete_batch`, `change_visibility`, `purge` and
    /// `stats`, which touch nothing of that queue.
    async fn receive(&self, request: ReceiveRequest) -> Result<Vec<Received>> {
        self.receive_or_stop(request, std::future::pending()).await
    }

    /// A receive looks (runs its statements, each committing deliveries)
    /// and parks in turn. `stop` is looked at before the first look,
    /// while parked, and before parking: a look is never cut short, so
    /// whatever its statements delivered is returned, and a receive that
    /// was parked, or had not looked yet, delivered nothing, so giving up
    /// there loses nothing.
    async fn receive_or_stop(
        &self,
        request: ReceiveRequest,
        stop: impl Future<Output = ()> + Send,
    ) -> Result<Vec<Received>> {
        request.validate()?;
        tokio::pin!(stop);
        // Told to stop before it began: a look now would deliver messages
        // only for the caller to hand back, each one more receive on its
        // count toward the dead-letter queue.
        if stop.as_mut().now_or_never().is_some() {
            return Ok(Vec::new());
        }
        if request.wait.is_zero() {
            return self.receive_once(&request).await;
        }
        let deadline = Instant::now() + request.wait;
        // With Listen::Off the waker has no listener and never notifies:
        // only the family's timer, `poll_interval` and `wait` wake us.
        let waker = self.waker().await?;
        let notify = waker.notify.clone();
        let visible = waker.visible.wake();
        let mut woken = Woken::Waited;
        loop {
            // Registered before looking, so a send committed, or a message
            // becoming visible, between the look and the wait still wakes
            // us.
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let visible_now = visible.notified();
            tokio::pin!(visible_now);
            visible_now.as_mut().enable();
            // A notification or the timer woke this receiver alone: if it
            // is dropped or fails before its look is done, the next one
            // looks.
            let mut pass_on = PassOn(match woken {
                Woken::Notified => Some(&*notify),
                Woken::Visible => Some(visible),
                Woken::Waited => None,
            });
            let Look {
                received,
                more,
                next_visible,
                ..
            } = self.receive_looking(&request).await?;
            pass_on.0 = None;
            let now = Instant::now();
            if received.len() >= request.max_messages {
                // A full batch: there may be more than this receive could
                // take, and a notification wakes one receiver, so pass it
                // on. (A receive that took fewer saw the queue drained.)
                // Woken by the family's timer, pass on the timer's wake:
                // the receiver it wakes may take the rest and stop, and
                // only one woken by the timer passes on what it took to
                // the next (below), so that a look is made after the last
                // delivery and the timer is set for what comes after.
                if woken == Woken::Visible {
                    visible.notify_one();
                } else {
                    notify.notify_one();
                }
            } else if woken == Woken::Visible
                && !received.is_empty()
                && self.inner.parked.load(Ordering::SeqCst) > 0
            {
                // Woken by the family's timer, and it delivered: the
                // parked receivers' looks saw no further than what it
                // took, so what becomes visible after it is known to
                // nobody. One more looks, and sets the timer for that.
                // (Nobody parked: every receiver of the family is looking
                // or about to, and learns it then.)
                visible.notify_one();
            }
            if !received.is_empty() || now >= deadline {
                // Leaving without parking: the time this look found is
                // still the family's. Its parked receivers may have looked
                // before that message was sent or handed back (this one was
                // woken for it, and its wait ended first), and nobody else
                // may know of it.
                if let Some(next_visible) = next_visible {
                    waker.visible.set(next_visible);
                }
                return Ok(received);
            }
            if more {
                // A backlog it did not deliver (expired, moved or held
                // back) filled its budget: look on now, not at the next
                // poll. Unless told to stop: looking on would deliver more.
                if stop.as_mut().now_or_never().is_some() {
                    return Ok(received);
                }
                continue;
            }
            let until = deadline.min(now + self.inner.options.poll_interval);
            self.inner.parked.fetch_add(1, Ordering::SeqCst);
            let _unpark = Unpark(&self.inner.parked);
            // A message that becomes visible during the wait (a delay, a
            // hand-back or a lease running out) is looked for then: no
            // notification announces it. The family's timer wakes one
            // receiver for it. Set once this receive counts as parked: a
            // receiver the timer woke that delivered and saw nobody parked
            // passed nothing on, but then this look was made before that
            // time (after it, it would have found the message), so the
            // time set here is past and the timer wakes a receiver at once.
            if let Some(next_visible) = next_visible {
                waker.visible.set(next_visible);
            }
            // `biased`, stop first: a stop that came during the look ends
            // the receive here, before it parks. A wake this receive took
            // and did not act on is passed on when `notified` or
            // `visible_now` is dropped.
            woken = tokio::select! {
                biased;
                () = &mut stop => return Ok(received),
                _ = &mut notified => Woken::Notified,
                _ = &mut visible_now => Woken::Visible,
                _ = tokio::time::sleep_until(until.into()) => Woken::Waited,
            };
        }
    }

    async fn delete(&self, receipt: &Receipt) -> Result<()> {
        let Some(parts) = self.receipt_parts(receipt) else {
            return Err(self.count_stale(receipt, 1));
        };
        if self.inner.fifo {
            let deleted = self.delete_fifo(&[parts.id], &[parts.generation]).await?;
            if deleted.is_empty() {
                return Err(self.stale_or_gone(receipt, 1).await?);
            }
            metrics::counter!("pgonce_queue_deleted_total", "queue" => self.inner.name.clone())
                .increment(1);
            return Ok(());
        }
        let done = sqlx::query(include_str!("sql/delete.sql"))
            .bind(&self.inner.name)
            .bind(parts.id)
            .bind(parts.generation)
            .execute(&self.inner.pool)
            .await?;
        if done.rows_affected() == 0 {
            return Err(self.stale_or_gone(receipt, 1).await?);
        }
        metrics::counter!("pgonce_queue_deleted_total", "queue" => self.inner.name.clone())
            .increment(1);
        Ok(())
    }

    async fn delete_batch(&self, receipts: &[Receipt]) -> Result<Vec<Receipt>> {
        if receipts.len() > MAX_BATCH {
            return Err(Error::Invalid {
                what: "batch",
                why: format!("a batch holds at most {MAX_BATCH} receipts"),
            });
        }
        // Foreign and malformed receipts are stale without a look.
        let parts: Vec<Option<(i64, i64)>> = receipts
            .iter()
            .map(|r| self.receipt_parts(r).map(|p| (p.id, p.generation)))
            .collect();
        let (ids, generations): (Vec<i64>, Vec<i64>) = parts.iter().flatten().copied().unzip();
        let deleted: Vec<DeletedRow> = if ids.is_empty() {
            Vec::new()
        } else if self.inner.fifo {
            self.delete_fifo(&ids, &generations).await?
        } else {
            sqlx::query_as(include_str!("sql/delete_batch.sql"))
                .bind(&self.inner.name)
                .bind(&ids)
                .bind(&generations)
                .fetch_all(&self.inner.pool)
                .await?
        };
        let deleted: std::collections::HashSet<(i64, i64)> =
            deleted.iter().map(|d| (d.id, d.generation)).collect();
        let stale: Vec<Receipt> = receipts
            .iter()
            .zip(&parts)
            .filter(|(_, p)| !matches!(p, Some(key) if deleted.contains(key)))
            .map(|(r, _)| r.clone())
            .collect();
        if deleted.is_empty() && !stale.is_empty() {
            // Nothing deleted: the queue may be gone, which is no batch
            // of stale receipts.
            if let gone @ Error::QueueNotFound { .. } =
                self.stale_or_gone(&stale[0], stale.len() as u64).await?
            {
                return Err(gone);
            }
        } else if !stale.is_empty() {
            self.count_stale(&stale[0], stale.len() as u64);
        }
        metrics::counter!("pgonce_queue_deleted_total", "queue" => self.inner.name.clone())
            .increment(deleted.len() as u64);
        Ok(stale)
    }

    async fn change_visibility(&self, receipt: &Receipt, timeout: Duration) -> Result<()> {
        if timeout > Duration::from_secs(12 * 3600) {
            return Err(Error::Invalid {
                what: "visibility timeout",
                why: "at most 12 hours".into(),
            });
        }
        let Some(parts) = self.receipt_parts(receipt) else {
            return Err(self.count_stale(receipt, 1));
        };
        let sooner: Option<bool> = sqlx::query_scalar(include_str!("sql/change_visibility.sql"))
            .bind(&self.inner.name)
            .bind(parts.id)
            .bind(parts.generation)
            .bind(millis(timeout))
            .bind(self.inner.fifo)
            .fetch_optional(&self.inner.pool)
            .await?;
        let Some(sooner) = sooner else {
            return Err(self.stale_or_gone(receipt, 1).await?);
        };
        if timeout.is_zero() || sooner {
            // Released: receivable now, as if just sent. Or handed back
            // for less than the time left: a long poll parked until the
            // old time (receive_next_visible.sql's `next_visible`) looks again and
            // waits for the new one.
            self.sent();
        }
        Ok(())
    }

    async fn purge(&self) -> Result<u64> {
        let PurgedRow { found, purged } = sqlx::query_as(include_str!("sql/purge.sql"))
            .bind(&self.inner.name)
            .bind(self.inner.fifo)
            .fetch_one(&self.inner.pool)
            .await?;
        if !found {
            return Err(self.not_found());
        }
        Ok(purged as u64)
    }

    async fn stats(&self) -> Result<QueueStats> {
        let row: Option<StatsRow> = sqlx::query_as(include_str!("sql/stats.sql"))
            .bind(&self.inner.name)
            .bind(self.inner.fifo)
            .fetch_optional(&self.inner.pool)
            .await?;
        let Some(row) = row else {
            return Err(Error::QueueNotFound {
                name: self.inner.name.clone(),
            });
        };
        Ok(QueueStats {
            depth: row.depth as u64,
            in_flight: row.in_flight as u64,
            delayed: row.delayed as u64,
            oldest_age: row
                .oldest_ms
                .map(|ms| Duration::from_millis(ms.max(0) as u64)),
            dead_letter_depth: row.dead_letter_queue.map(|_| row.dead_letter_depth as u64),
        })
    }

    async fn redrive(&self) -> Result<u64> {
        let mut moved = 0u64;
        // The sources found gone, whose letters stay (redrive_batch).
        let mut gone = Vec::new();
        loop {
            let known_gone = gone.len();
            let (picked, batch_moved) = self.redrive_batch(&mut gone).await?;
            moved += batch_moved;
            // Letters of a source found gone took places of this batch:
            // look again past them.
            if gone.len() > known_gone {
                continue;
            }
            // A full batch that moved nothing was overtaken by receives of
            // the dead-letter queue: what they hold stays, as it would have.
            if picked < MAX_BATCH || batch_moved == 0 {
                break;
            }
        }
        if moved > 0 {
            tracing::info!(queue = %self.inner.name, moved, "redrove dead letters");
            metrics::counter!("pgonce_queue_redriven_total", "queue" => self.inner.name.clone())
                .increment(moved);
        }
        gone.sort_unstable();
        if let Some(first) = gone.first() {
            tracing::warn!(queue = %self.inner.name, moved, ?gone, "dead letters of queues that are gone stay; the others were redriven");
            return Err(Error::QueueNotFound {
                name: first.clone(),
            });
        }
        Ok(moved)
    }
}

/// The deduplication id `message` is sent under: its own, or with
/// content-based deduplication that of its body.
fn dedup_id(message: &SendMessage, content_based: bool) -> Option<Cow<'_, str>> {
    match &message.dedup_id {
        Some(id) => Some(Cow::Borrowed(id)),
        None if content_based => Some(Cow::Owned(content_dedup_id(&message.body))),
        None => None,
    }
}

/// The deduplication id content-based deduplication gives a body: its
/// SHA-256, in hex, as SQS does.
fn content_dedup_id(body: &str) -> String {
    Sha256::digest(body.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The advisory lock keys of these FIFO groups, as (queue, group id)
/// pairs, ascending, once each: namespace `pgonce.queue/<queue>`, key the
/// group id. Ascending, so two transactions taking several cannot
/// deadlock on them.
fn group_lock_keys<'a>(groups: impl Iterator<Item = (&'a str, &'a str)>) -> Result<Vec<i64>> {
    let mut keys = groups
        .map(|(queue, group)| Ok(LockKey::new(&format!("pgonce.queue/{queue}"), group)?.as_i64()))
        .collect::<Result<Vec<i64>>>()?;
    keys.sort_unstable();
    keys.dedup();
    Ok(keys)
}

/// A dead-lettered message picked by a redrive (redrive_pick.sql).
#[derive(sqlx::FromRow)]
struct DeadLetterRow {
    id: i64,
    /// The queue it came from, where the redrive sends it back.
    source: String,
    group_id: Option<String>,
}

/// A queue a redrive sends dead letters back to (redrive_sources.sql).
#[derive(sqlx::FromRow)]
struct SourceQueueRow {
    name: String,
    fifo: bool,
}

/// One row of a receive statement: a delivery, a dead-letter move or an
/// expiry (the last two with only `fate` and `id`).
#[derive(sqlx::FromRow)]
struct ReceiveRow {
    fate: String,
    id: i64,
    body: Option<String>,
    attributes: Option<Json<BTreeMap<String, String>>>,
    group_id: Option<String>,
    receive_count: Option<i32>,
    generation: Option<i64>,
    sent_at: Option<time::OffsetDateTime>,
    /// The visibility the delivery got, in ms: the request's or the
    /// queue's.
    visibility_ms: Option<i64>,
    /// Only in the `next_visible` row (a statement that delivered
    /// nothing): in how many ms the queue's next message becomes visible.
    next_visible_ms: Option<i64>,
    /// Only in a `dead_lettered` row: the dead-letter queue the message
    /// moved to.
    dead_letter_queue: Option<String>,
}

/// What one look of a receive (its statements) found.
#[derive(Default)]
struct Look {
    received: Vec<Received>,
    /// It stopped at its budget with messages it did not deliver still
    /// ahead: a long poll looks again at once instead of parking.
    more: bool,
    /// It delivered nothing, and a message of the queue becomes visible at
    /// this time: a long poll wakes then to look again.
    next_visible: Option<Instant>,
    /// The ids its statements delivered or held back: each later
    /// statement of the look passes over them.
    passed_over: Vec<i64>,
    /// The dead-letter queues its statements moved messages to (each
    /// statement committed its moves): their receivers are woken once the
    /// look's statements are done, which empties it.
    dead_letter_queues: Vec<String>,
}

/// A queue's row, as much of it as a handle needs (`open_queue.sql`).
#[derive(sqlx::FromRow)]
struct QueueRow {
    fifo: bool,
    content_based_dedup: bool,
}

impl QueueRow {
    /// The queue named `name`, or `None` when there is none.
    async fn read<'c, E>(executor: E, name: &str) -> Result<Option<QueueRow>>
    where
        E: sqlx::PgExecutor<'c>,
    {
        Ok(sqlx::query_as(include_str!("sql/open_queue.sql"))
            .bind(name)
            .fetch_optional(executor)
            .await?)
    }
}

/// A batch's messages as the columns its send statements take
/// (`sql/send_batch.sql`, `sql/send_batch_dedup.sql`), in input order.
struct BatchColumns<'m> {
    bodies: Vec<&'m str>,
    attributes: Vec<Json<&'m BTreeMap<String, String>>>,
    groups: Vec<Option<&'m str>>,
    /// The messages' own delays in milliseconds (`None`: the queue's).
    delays: Vec<Option<i64>>,
}

impl<'m> BatchColumns<'m> {
    fn of(messages: &'m [SendMessage]) -> Self {
        BatchColumns {
            bodies: messages.iter().map(|m| m.body.as_str()).collect(),
            attributes: messages.iter().map(|m| Json(&m.attributes)).collect(),
            groups: messages.iter().map(|m| m.group_id.as_deref()).collect(),
            delays: messages.iter().map(|m| m.delay.map(millis)).collect(),
        }
    }
}

/// What `send.sql` returns: the message's id, and whether the send was a
/// duplicate of an earlier one (the id is then that message's).
#[derive(sqlx::FromRow)]
struct SentRow {
    id: i64,
    duplicate: bool,
}

/// One delivery deleted by `delete_batch`.
#[derive(sqlx::FromRow)]
struct DeletedRow {
    id: i64,
    generation: i64,
    /// Its FIFO group has another message in the queue (delete_fifo.sql).
    group_goes_on: bool,
}

/// What a receipt of the PostgreSQL queue names: one delivery (the
/// message's generation when it was issued) of one message in one queue.
/// Text form `<queue>:<id>:<generation>`; queue names hold no `:`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ReceiptParts<'a> {
    queue: &'a str,
    id: i64,
    generation: i64,
}

impl<'a> ReceiptParts<'a> {
    fn parse(text: &'a str) -> Option<ReceiptParts<'a>> {
        let mut parts = text.split(':');
        let (queue, id, generation) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || validate_name(queue).is_err() {
            return None;
        }
        let parts = ReceiptParts {
            queue,
            id: id.parse().ok()?,
            generation: generation.parse().ok()?,
        };
        // Only the exact text issued: no sign, no leading zeros.
        (parts.receipt().0 == text).then_some(parts)
    }

    fn receipt(&self) -> Receipt {
        Receipt(format!("{}:{}:{}", self.queue, self.id, self.generation))
    }
}

/// What purge.sql did: whether the handle's queue was there, and how
/// many messages it deleted.
#[derive(sqlx::FromRow)]
struct PurgedRow {
    found: bool,
    purged: i64,
}

/// A row of stats.sql: the counts of one queue, and of its dead-letter
/// queue if it has one.
#[derive(sqlx::FromRow)]
struct StatsRow {
    depth: i64,
    in_flight: i64,
    delayed: i64,
    /// The age of the oldest message, in ms; `None`: the queue is empty.
    oldest_ms: Option<i64>,
    dead_letter_depth: i64,
    dead_letter_queue: Option<String>,
}

/// When a send wakes the receivers: by a NOTIFY inside its transaction
/// (delivered at the caller's commit), or after the statement committed on
/// the pool, through the handle's [`Notifier`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    InTransaction,
    AfterCommit,
}

/// Wakes one more parked receiver when dropped holding a [`Notify`]: a
/// receive woken by a notification or by the family's timer (each wakes
/// one receiver of the family) and cancelled or failed before its look
/// completed, so that the message it was woken for does not wait for the
/// others' poll interval. (A wake not yet taken is passed on by tokio
/// itself when the `Notified` is dropped; this covers the one the receive
/// took.)
struct PassOn<'a>(Option<&'a Notify>);

impl Drop for PassOn<'_> {
    fn drop(&mut self) {
        if let Some(notify) = self.0 {
            notify.notify_one();
        }
    }
}

/// Which of a receive's statements runs ([`PgQueue::receive_looking`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Statement {
    /// The first: may deliver every message it looks at; on a standard
    /// queue the lean statement, which only delivers.
    First,
    /// A follow-up: delivers at most `room` of the messages it looks at,
    /// and decides every fate.
    FollowUp { room: usize },
}

/// What ended a receive's last wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Woken {
    /// A notification, which woke this receiver alone.
    Notified,
    /// The family's timer: a message its looks found coming is visible
    /// now; it woke this receiver alone.
    Visible,
    /// Its own time (`poll_interval`, the end of `wait`), or nothing yet.
    Waited,
}

struct Unpark<'a>(&'a AtomicUsize);

impl Drop for Unpark<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `d` in the whole milliseconds the queue's tables store, rounded up: a
/// visibility, delay, retention or window is at least what was asked (a
/// visibility of 0.5 ms rounded down would make the message visible at
/// once, as a release does). Every caller bounds `d` first (at most 14
/// days), so the rounding never passes a bound.
fn millis(d: Duration) -> i64 {
    d.as_nanos().div_ceil(1_000_000).min(i64::MAX as u128) as i64
}

fn parse_id(id: &str) -> Result<i64> {
    id.parse().map_err(|_| Error::Invalid {
        what: "message id",
        why: format!("{id:?} is not a message id of the PostgreSQL queue"),
    })
}

fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 80
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid {
            what: "queue name",
            why: format!("{name:?}: 1 to 80 characters of A-Z a-z 0-9 _ - ."),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_stored_in_milliseconds_rounded_up() {
        assert_eq!(millis(Duration::ZERO), 0);
        assert_eq!(millis(Duration::from_nanos(1)), 1);
        assert_eq!(millis(Duration::from_micros(500)), 1);
        assert_eq!(millis(Duration::from_millis(7)), 7);
        assert_eq!(millis(Duration::from_micros(7_001)), 8);
        assert_eq!(millis(crate::queue::MAX_VISIBILITY), 12 * 3600 * 1000);
    }

    #[test]
    fn attributes_are_validated() {
        assert!(QueueAttributes::default().validate().is_ok());
        let dlq_without_count = QueueAttributes {
            dead_letter_queue: Some("dlq".into()),
            ..QueueAttributes::default()
        };
        assert!(matches!(
            dlq_without_count.validate(),
            Err(Error::Invalid { .. })
        ));
        assert!(validate_name("orders.fifo").is_ok());
        assert!(validate_name("a b").is_err());
        assert!(validate_name("").is_err());
    }

    #[test]
    fn a_receipt_parses_only_in_the_exact_form_issued() {
        let parts = ReceiptParts {
            queue: "orders.fifo",
            id: 17,
            generation: 3,
        };
        let receipt = parts.receipt();
        assert_eq!(receipt.0, "orders.fifo:17:3");
        assert_eq!(ReceiptParts::parse(&receipt.0), Some(parts));
        for text in [
            "",
            "17.3",
            "orders.fifo:17",
            "orders.fifo:17:3:1",
            ":17:3",
            "a b:17:3",
            "orders.fifo:+17:3",
            "orders.fifo:017:3",
            "orders.fifo:17:x",
        ] {
            assert_eq!(ReceiptParts::parse(text), None, "{text:?}");
        }
    }

    #[test]
    fn oversized_and_malformed_messages_are_typed_errors() {
        let big = SendMessage::new("x".repeat(MAX_BODY_BYTES + 1));
        assert!(matches!(
            big.validate(false),
            Err(Error::MessageTooLarge { .. })
        ));
        assert!(matches!(
            SendMessage::new("").validate(false),
            Err(Error::Invalid { .. })
        ));
        assert!(matches!(
            SendMessage::new("a\0b").validate(false),
            Err(Error::Invalid { .. })
        ));
        assert!(
            SendMessage::new("x").validate(true).is_err(),
            "fifo needs a group"
        );
        assert!(SendMessage::new("x").group("g").validate(false).is_err());
    }
}
