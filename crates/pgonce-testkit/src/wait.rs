//! Waiting in a test for a state to appear, with a bound.
//!
//! A test that polls for a state (a receiver parked, a job reaped, a
//! session blocked) would otherwise hang until the harness kills the whole
//! binary when the state never comes, which is the very defect the test
//! exists to catch. [`wait_until`] polls under [`FAILSAFE`] and panics
//! naming what it waited for. The bound only stops a hang: a verdict never
//! rests on it.

use std::future::Future;
use std::time::Duration;

/// How long a test waits for something that should happen at once.
///
/// Only reached when what a test waits for never happens; a verdict never
/// rests on it. Generous, so that a slow machine never reaches it.
pub const FAILSAFE: Duration = Duration::from_secs(120);

/// Polls `check` until it returns true, yielding to the runtime between
/// polls; panics with "waited 120s for {what}" past [`FAILSAFE`] (the
/// message prints the bound).
///
/// `what` names the state awaited, as the panic message reads it.
pub async fn wait_until<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll_until(what, Duration::ZERO, check).await;
}

/// [`wait_until`], sleeping `between` polls instead of only yielding: for a
/// check that costs a query.
pub async fn wait_until_every<F, Fut>(what: &str, between: Duration, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll_until(what, between, check).await;
}

async fn poll_until<F, Fut>(what: &str, between: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let polls = async {
        while !check().await {
            if between.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(between).await;
            }
        }
    };
    if tokio::time::timeout(FAILSAFE, polls).await.is_err() {
        panic!("waited {FAILSAFE:?} for {what}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a wait whose check never holds to its failsafe on the paused
    /// clock, moved on by hand a second at a time (a poll that only yields
    /// never leaves the runtime idle, so the clock would not move on its
    /// own), and returns its panic message.
    async fn panic_past_failsafe(wait: impl Future<Output = ()> + Send + 'static) -> String {
        let waiting = tokio::spawn(wait);
        let mut waited = Duration::ZERO;
        while !waiting.is_finished() {
            assert!(
                waited <= FAILSAFE * 2,
                "still waiting at twice the failsafe"
            );
            tokio::time::advance(Duration::from_secs(1)).await;
            waited += Duration::from_secs(1);
        }
        let panic = waiting.await.expect_err("the wait gave up").into_panic();
        *panic.downcast::<String>().expect("a formatted message")
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_that_never_holds_panics_naming_what_it_waited_for() {
        let message =
            panic_past_failsafe(wait_until("a state that never comes", || async { false })).await;
        assert_eq!(
            message,
            format!("waited {FAILSAFE:?} for a state that never comes")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_between_sleeps_is_bounded_too() {
        let message = panic_past_failsafe(wait_until_every(
            "a row that never shows",
            Duration::from_millis(10),
            || async { false },
        ))
        .await;
        assert_eq!(
            message,
            format!("waited {FAILSAFE:?} for a row that never shows")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_that_holds_returns() {
        let mut polls = 0;
        wait_until("the third poll", || {
            polls += 1;
            let done = polls == 3;
            async move { done }
        })
        .await;
        assert_eq!(polls, 3);
    }
}
