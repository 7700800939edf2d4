//! Wakes the parked receivers of a queue after a send committed, one
//! `NOTIFY` at a time for any number of sends.
//!
//! Why not NOTIFY inside the sending transaction: PostgreSQL serializes the
//! commits of notifying transactions (the commit takes a database-wide lock
//! before its WAL flush and holds it until the transaction has ended), so
//! every send that notified waited for the flush of every other one, and
//! concurrent senders lost group commit. Here the send commits without
//! notifying; then one task per handle family sends `pg_notify` in a
//! transaction of its own. That transaction is given a transaction id (a
//! notification carries its sender's), but it writes no WAL before its
//! commit record, and PostgreSQL commits such a transaction without
//! waiting for a flush (`RecordTransactionCommit`), so it holds that lock
//! only briefly. Sends that commit while a notification is on its way are
//! covered by the next one: at most one is in flight, and one is always
//! sent after the last send.
//!
//! What it costs: a receiver is woken one round trip after the commit
//! instead of at it; a process that dies between a commit and its
//! notification leaves the receivers to their `poll_interval`, as a lost
//! notification always did (the LISTEN connection can drop too). A handle
//! family dropped with a notification owed (its last handle dropped as
//! soon as a send returned) lets the task send it first: the task ends
//! then, or with its runtime. Sends in
//! the caller's transaction (`send_in`) still notify inside it: only the
//! caller knows when it commits.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::PgPool;
use tokio::sync::Notify;

use super::CHANNEL;

/// One per handle family; the task stops when this is dropped, once it
/// has sent the notification it owes, if any.
pub(super) struct Notifier {
    state: Arc<State>,
}

struct State {
    /// A send committed since the last notification was sent.
    pending: AtomicBool,
    /// The handle family is gone: no send will come after what is pending.
    closed: AtomicBool,
    wake: Notify,
}

impl Notifier {
    /// Starts the task (on the current Tokio runtime).
    pub(super) fn start(pool: PgPool, queue: String) -> Notifier {
        let state = Arc::new(State {
            pending: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            wake: Notify::new(),
        });
        tokio::spawn(run(pool, queue, state.clone()));
        Notifier { state }
    }

    /// Asks for a notification after a send committed. Returns at once.
    pub(super) fn sent(&self) {
        self.state.pending.store(true, Ordering::SeqCst);
        // notify_one keeps a permit when the task is busy sending, so the
        // send recorded above is covered by a notification sent after it.
        self.state.wake.notify_one();
    }
}

impl Drop for Notifier {
    /// Not an abort: the last send's notification may not have been sent
    /// yet (the task runs after the send returned), and aborted it never
    /// was, so receivers parked on other handle families slept to their
    /// poll interval past the message.
    fn drop(&mut self) {
        self.state.closed.store(true, Ordering::SeqCst);
        self.state.wake.notify_one();
    }
}

async fn run(pool: PgPool, queue: String, state: Arc<State>) {
    loop {
        state.wake.notified().await;
        // Cleared before the notification is sent: a send recorded while it
        // is on its way sets it again and gets a notification of its own.
        while state.pending.swap(false, Ordering::SeqCst) {
            if let Err(e) = sqlx::query(include_str!("../sql/notify.sql"))
                .bind(CHANNEL)
                .bind(&queue)
                .execute(&pool)
                .await
            {
                // Receivers still look at their poll_interval.
                tracing::warn!(queue = %queue, error = %e, "queue notification not sent");
            }
        }
        // Set before the wake that got here, after the family's last send.
        if state.closed.load(Ordering::SeqCst) {
            return;
        }
    }
}
