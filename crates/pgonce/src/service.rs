//! The one loop every background service (reaper, re-driver, dedupe
//! collector, maintenance) runs: a pass every interval until shutdown, a
//! failed pass counted and the next one tried; and [`FailingPasses`], how
//! such a loop (the incident service's notifier too) tells of its failed
//! passes.
//!
//! # Failed passes
//!
//! A pass that fails (the database down or refusing logins, a role without
//! the rights) counts in the counter
//! `pgonce_service_failed_passes_total{service}`, and the loop goes on. The
//! log says what an operator needs without a line per pass: the first
//! failure of a run of them at warn, with its error; while they go on, at
//! most one warn line a minute, with how many failed since when and the
//! latest error (each failure in between at debug); and, once a pass
//! succeeds again, one info line saying after how many failures. A
//! [`crate::Worker`]'s failed receives are told the same way.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

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
/// a pass under way, whose open transaction then rolls back. A failed pass
/// is counted and logged as [`FailingPasses`] does (module docs, Failed
/// passes); the next one comes after `interval` all the same.
pub async fn run_every<T, E, Fut>(
    name: &'static str,
    interval: Duration,
    shutdown: impl Future<Output = ()>,
    mut pass: impl FnMut() -> Fut,
) where
    E: std::fmt::Display,
    Fut: Future<Output = std::result::Result<T, E>>,
{
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = FailingPasses::new(name);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tick.tick() => match pass().await {
                Ok(_) => failing.succeeded(),
                Err(e) => {
                    failing.failed(&e);
                }
            },
        }
    }
}

/// While failures go on one after the other, one line about them is
/// logged at warn at most this often (module docs, Failed passes).
pub const FAILURES_LOGGED_EVERY: Duration = Duration::from_secs(60);

/// A run of failures: passes (or receives, probes) that failed one after
/// the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailingRun {
    /// How many failed so far.
    pub count: u64,
    /// When the first failed, by the wall clock (for the log).
    pub since: time::OffsetDateTime,
    /// When the last line about the run was logged.
    logged_at: Instant,
}

/// What to log of a failure.
#[derive(Debug, PartialEq, Eq)]
pub enum Failure {
    /// The first of a run: at warn, with its error.
    First,
    /// The run goes on, and no line about it was logged for
    /// [`FAILURES_LOGGED_EVERY`]: at warn, how many since when.
    StillFailing(FailingRun),
    /// Logged about lately: at debug only.
    Quiet,
}

/// The run of failures going on in one loop, if any, deciding which
/// failures the log tells of at warn. Its clock is tokio's, so that a
/// test's paused clock drives it.
///
/// Written here, not taken from a crate: `tracing` limits no rate of its
/// own, and the crates that do (`tracing-throttle`) are subscriber layers,
/// which the application installs, not a library; they drop repeats of a
/// line, but say neither how many failed since when in the line that gets
/// through nor when the failures stopped.
///
/// [`FailingPasses`] logs and counts with it; take it for failures that
/// are not a loop's passes, to log them in words of their own.
#[derive(Debug, Default)]
pub struct Failures(Option<FailingRun>);

impl Failures {
    /// A failure at `now` (`wall`, by the wall clock): what to log.
    pub fn failed(&mut self, now: Instant, wall: time::OffsetDateTime) -> Failure {
        let Some(run) = &mut self.0 else {
            self.0 = Some(FailingRun {
                count: 1,
                since: wall,
                logged_at: now,
            });
            return Failure::First;
        };
        run.count += 1;
        if now.saturating_duration_since(run.logged_at) < FAILURES_LOGGED_EVERY {
            return Failure::Quiet;
        }
        run.logged_at = now;
        Failure::StillFailing(*run)
    }

    /// A success: the run of failures it ended, if any.
    pub fn succeeded(&mut self) -> Option<FailingRun> {
        self.0.take()
    }
}

/// The failed passes of one background loop: each counted in
/// `pgonce_service_failed_passes_total{service}`, and logged the first at
/// warn, then a warn line a minute at most while they go on, and an info
/// line once a pass succeeds again (module docs, Failed passes). For a
/// loop of passes of one's own; pgonce's loops use it already.
#[derive(Debug)]
pub struct FailingPasses {
    service: &'static str,
    failures: Failures,
}

impl FailingPasses {
    /// No pass of the loop named `service` (the `service` label and log
    /// field) has failed yet.
    pub fn new(service: &'static str) -> FailingPasses {
        FailingPasses {
            service,
            failures: Failures::default(),
        }
    }

    /// A pass failed with `error`: counted and logged. Returns how many
    /// passes have failed one after the other, this one included (to back
    /// off by).
    pub fn failed(&mut self, error: &dyn std::fmt::Display) -> u64 {
        let service = self.service;
        metrics::counter!("pgonce_service_failed_passes_total", "service" => service).increment(1);
        let what = self
            .failures
            .failed(Instant::now(), time::OffsetDateTime::now_utc());
        let count = self.failures.0.map_or(1, |run| run.count);
        match what {
            Failure::First => {
                tracing::warn!(service, error = %error, "{service} pass failed; retrying")
            }
            Failure::StillFailing(run) => {
                tracing::warn!(service, failed = run.count, since = %run.since, error = %error,
                    "{service} passes still failing: {} failed since {}; retrying", run.count, run.since)
            }
            Failure::Quiet => {
                tracing::debug!(service, error = %error, "{service} pass failed; retrying")
            }
        }
        count
    }

    /// A pass succeeded: logs the end of the run of failures it ended, if
    /// any.
    pub fn succeeded(&mut self) {
        if let Some(run) = self.failures.succeeded() {
            let service = self.service;
            tracing::info!(service, failed = run.count, since = %run.since,
                "{service} pass succeeded after {} failed passes since {}", run.count, run.since);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of failures is told at warn at its first failure, then
    /// once per [`FAILURES_LOGGED_EVERY`] with how many failed
    /// since when, and its end gives the count; the next failure starts a
    /// new run. The clock is given, not read: no waiting.
    #[test]
    fn failures_are_logged_first_then_once_a_minute_then_at_recovery() {
        let start = Instant::now();
        let at = |secs: u64| start + Duration::from_secs(secs);
        let wall = time::OffsetDateTime::UNIX_EPOCH;
        let later = wall + Duration::from_secs(1000);
        let mut failures = Failures::default();
        assert_eq!(failures.succeeded(), None, "nothing failed");
        assert_eq!(failures.failed(at(0), wall), Failure::First);
        for secs in 1..60 {
            assert_eq!(failures.failed(at(secs), later), Failure::Quiet, "{secs}");
        }
        let still = FailingRun {
            count: 61,
            since: wall,
            logged_at: at(60),
        };
        assert_eq!(failures.failed(at(60), later), Failure::StillFailing(still));
        assert_eq!(failures.failed(at(119), later), Failure::Quiet);
        assert!(matches!(
            failures.failed(at(120), later),
            Failure::StillFailing(FailingRun { count: 63, .. })
        ));
        assert!(matches!(
            failures.succeeded(),
            Some(FailingRun { count: 63, since, .. }) if since == wall
        ));
        assert_eq!(failures.succeeded(), None, "told once");
        assert_eq!(failures.failed(at(121), later), Failure::First);
    }
}
