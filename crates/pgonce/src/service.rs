//! The one loop every background service (reaper, re-driver, dedupe
//! collector, maintenance) runs: a pass every interval until shutdown, a
//! failed pass logged and the next one tried.

use std::future::Future;
use std::time::Duration;

use crate::error::{Error, Result};

/// Checks the settings every service shares: a non-zero interval and a batch
/// size of at least 1.
pub(crate) fn check_config(what: &'static str, interval: Duration, batch_size: i64) -> Result<()> {
    if interval.is_zero() || batch_size < 1 {
        return Err(Error::Invalid {
            what,
            why: format!(
                "need a non-zero interval and batch_size >= 1, got {interval:?} and {batch_size}"
            ),
        });
    }
    Ok(())
}

/// Checks a cleaner's retention against
/// [`MAX_RETENTION`](crate::maintenance::MAX_RETENTION).
pub(crate) fn check_retention(what: &'static str, retention: Duration) -> Result<()> {
    if retention > crate::maintenance::MAX_RETENTION {
        return Err(Error::Invalid {
            what,
            why: format!(
                "a retention is at most 1,000 years (leave the cleaner out to keep rows for good), \
                 got {retention:?}"
            ),
        });
    }
    Ok(())
}

/// Runs `pass` now and then every `interval` until `shutdown` completes.
/// `shutdown` is heard between passes: a pass under way runs to its end
/// first (each of its transactions commits or rolls back whole), so the
/// loop never leaves a pass half done. Dropping the returned future drops
/// a pass under way, whose open transaction then rolls back.
pub(crate) async fn run_every<T, Fut>(
    name: &'static str,
    interval: Duration,
    shutdown: impl Future<Output = ()>,
    mut pass: impl FnMut() -> Fut,
) where
    Fut: Future<Output = Result<T>>,
{
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tick.tick() => {
                if let Err(e) = pass().await {
                    tracing::warn!(service = name, error = %e, "background pass failed");
                }
            }
        }
    }
}

/// What a caught panic said: its message when it was a string (as
/// `panic!` makes it), else "a panic".
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}
