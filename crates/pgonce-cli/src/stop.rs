//! How `pgonce` stops on Ctrl-C (SIGINT) and SIGTERM (what `kill`, a
//! service manager or a container runtime sends).
//!
//! A command stops at once on the first signal: its future is dropped, and
//! with it its throwaway database or cluster and the child processes it
//! started (`kill_on_drop`). A service (`serve`, `worker`) stops at once
//! while it is still starting (connecting, migrating: each migration is a
//! transaction, rolled back). Once it runs, the first signal drains it
//! (stop taking work, finish what is in hand) and a second one stops it at
//! once, as an operator pressing Ctrl-C again or an orchestrator escalating
//! expects: what was in hand is left unacked, and the queue redelivers it
//! after its visibility timeout; a notification being posted stays claimed,
//! and is sent again (same idempotency key) once its lease ends.
//!
//! Stopping the process does not stop a statement it had sent: PostgreSQL
//! finishes it (a lock wait goes on until the lock is released, and a
//! statement that is its own transaction then commits), unless the role or
//! database sets `client_connection_check_interval`, with which the server
//! ends the session, rolled back, once it sees the client gone.
//!
//! The handlers are installed before anything else runs and stay for the
//! whole run: a signal is always the command's to answer, never the
//! default disposition's (which would kill the process and leave its
//! throwaway database behind), and never swallowed by a handler no one
//! listens to any more.

use tokio::sync::watch;

/// A signal stopped the run; it was abandoned and cleaned up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interrupted {
    /// `SIGINT` or `SIGTERM`.
    pub signal: &'static str,
    /// What a shell reports for a process the signal ended: 128 + its number.
    pub code: u8,
    /// It came while a service was draining after an earlier signal.
    pub while_draining: bool,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted ({})", self.signal)
    }
}

impl std::error::Error for Interrupted {}

const SIGINT: Interrupted = Interrupted {
    signal: "SIGINT",
    code: 130,
    while_draining: false,
};

const SIGTERM: Interrupted = Interrupted {
    signal: "SIGTERM",
    code: 143,
    while_draining: false,
};

/// The process's stop signals, listened for from [`StopSignals::listen`]
/// on: one that comes before anything awaits it is kept for [`next`].
///
/// [`next`]: StopSignals::next
pub struct StopSignals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers of SIGINT and SIGTERM (Ctrl-C elsewhere).
    pub fn listen() -> std::io::Result<StopSignals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(StopSignals {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        {
            Ok(StopSignals {})
        }
    }

    /// The next signal.
    pub async fn next(&mut self) -> Interrupted {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.interrupt.recv() => SIGINT,
                _ = self.terminate.recv() => SIGTERM,
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            SIGINT
        }
    }
}

/// Where a service is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Connecting, migrating, opening its queue: a signal stops it at once.
    Starting,
    /// Taking work: the first signal drains it.
    Running,
    /// Draining since this signal: the next one stops it at once.
    Draining(Interrupted),
}

/// What the service and the signals share: the service says when it runs
/// ([`running`](ServiceStop::running)) and waits for the signal to drain
/// ([`drain_requested`](ServiceStop::drain_requested)); the command races
/// it against [`stop_now`](ServiceStop::stop_now).
pub struct ServiceStop {
    phase: watch::Sender<Phase>,
}

impl Default for ServiceStop {
    /// A service that is starting.
    fn default() -> ServiceStop {
        ServiceStop {
            phase: watch::Sender::new(Phase::Starting),
        }
    }
}

impl ServiceStop {
    /// The service takes work from now on: the first signal drains it.
    pub fn running(&self) {
        self.phase.send_if_modified(|phase| {
            let starting = *phase == Phase::Starting;
            if starting {
                *phase = Phase::Running;
            }
            starting
        });
    }

    /// Resolves with the first signal after [`running`](ServiceStop::running).
    pub async fn drain_requested(&self) -> Interrupted {
        let mut phase = self.phase.subscribe();
        match phase
            .wait_for(|p| matches!(p, Phase::Draining(_)))
            .await
            .map(|p| *p)
        {
            Ok(Phase::Draining(signal)) => signal,
            // The sender is `self`'s, alive while this is awaited.
            _ => std::future::pending().await,
        }
    }

    /// Resolves with the signal that stops the service at once: any while
    /// it starts; once it runs, the one after the signal that drains it.
    pub async fn stop_now(&self, signals: &mut StopSignals) -> Interrupted {
        loop {
            let signal = signals.next().await;
            match *self.phase.borrow() {
                Phase::Starting => return signal,
                Phase::Draining(_) => {
                    return Interrupted {
                        while_draining: true,
                        ..signal
                    };
                }
                Phase::Running => {}
            }
            self.phase.send_replace(Phase::Draining(signal));
        }
    }
}
