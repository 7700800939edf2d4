//! One timer per handle family for when the queue's next message becomes
//! visible (sent with a delay, handed back with one, its lease running
//! out), as the family's looks found it (receive_next_visible.sql's
//! `next_visible`).
//!
//! Why one per family, not one per parked receiver: every receiver whose
//! look found nothing learnt the same time, and each slept to it, so all
//! of them woke at that instant to look for what was, most often, one
//! message, and all but one found nothing. Here a receive that found
//! nothing hands its time to the family's timer, which keeps the earliest
//! and, when it comes, wakes one parked receiver, as a notification does.
//! That receiver looks: one that delivered wakes the next (the others'
//! looks saw no further than this time, so what becomes visible after it
//! is known only to a look made now), and one that found nothing hands
//! the timer the next time it found. The timer runs in a task of the
//! family's, not in a receiver: a receive dropped, stopped or ended while
//! parked takes nothing with it, and a wake nobody is parked for is kept
//! for the next receiver to wait (tokio's `Notify` keeps one permit).

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{Notify, watch};

/// The family's timer; its task stops when this is dropped.
pub(super) struct VisibleTimer {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

struct Shared {
    /// The earliest time a look of the family found coming and nobody has
    /// been woken for yet; `None`: none known.
    at: watch::Sender<Option<Instant>>,
    /// Wakes one receiver when `at` comes.
    wake: Notify,
}

impl VisibleTimer {
    /// Starts the task (on the current Tokio runtime).
    pub(super) fn start() -> VisibleTimer {
        let shared = Arc::new(Shared {
            at: watch::Sender::new(None),
            wake: Notify::new(),
        });
        let task = tokio::spawn(run(shared.clone()));
        VisibleTimer { shared, task }
    }

    /// A look found a message that becomes visible at `at`: one receiver
    /// wakes then, unless the timer is set for earlier already (the look
    /// woken then sets it again for what it finds next).
    pub(super) fn set(&self, at: Instant) {
        self.shared.at.send_if_modified(|set| {
            let earlier = set.is_none_or(|set| at < set);
            if earlier {
                *set = Some(at);
            }
            earlier
        });
    }

    /// What a receiver waits on for the timer's wake, and what it passes
    /// that wake on to.
    pub(super) fn wake(&self) -> &Notify {
        &self.shared.wake
    }
}

impl Drop for VisibleTimer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(shared: Arc<Shared>) {
    let mut at = shared.at.subscribe();
    loop {
        let next = *at.borrow_and_update();
        let due = async {
            match next {
                // At most a wait's longest at a time: a time written by
                // hand far in the future is no sleep tokio's timer takes;
                // woken early, the timer finds it not yet due and sleeps on.
                Some(next) => {
                    let cap = Instant::now() + crate::queue::MAX_WAIT;
                    tokio::time::sleep_until(next.min(cap).into()).await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            changed = at.changed() => {
                // The sender lives in `shared`, which this task holds.
                if changed.is_err() {
                    return;
                }
            }
            () = due => {
                let fired = shared.at.send_if_modified(|set| {
                    let due = set.is_some_and(|set| set <= Instant::now());
                    if due {
                        *set = None;
                    }
                    due
                });
                if fired {
                    shared.wake.notify_one();
                }
            }
        }
    }
}
