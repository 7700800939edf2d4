//! What a test's subject logs, kept for the test to count: [`LogLines`].

use std::sync::{Arc, Mutex};

/// One event logged: its level, message and `error` field.
#[derive(Debug, Clone)]
pub struct LogLine {
    /// The event's level.
    pub level: tracing::Level,
    /// Its message.
    pub message: String,
    /// Its `error` field, if it has one.
    pub error: Option<String>,
}

/// Keeps every event logged on this thread while it is the default
/// subscriber's layer ([`LogLines::capture`]): the spawned tasks' too, on
/// a single-threaded runtime.
#[derive(Clone, Default)]
pub struct LogLines(Arc<Mutex<Vec<LogLine>>>);

impl LogLines {
    /// Makes a subscriber with these lines as its layer the default of this
    /// thread until the guard is dropped.
    pub fn capture(&self) -> tracing::subscriber::DefaultGuard {
        use tracing_subscriber::layer::SubscriberExt;
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }

    /// The lines kept so far of `level` whose message starts with `start`.
    pub fn starting(&self, level: tracing::Level, start: &str) -> Vec<LogLine> {
        let lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        lines
            .iter()
            .filter(|l| l.level == level && l.message.starts_with(start))
            .cloned()
            .collect()
    }

    /// Checks the lines a run of `failed` failures lasting `lasting` left,
    /// as pgonce's loops log one: the first at warn, its message starting
    /// with `first`; at most one warn line a minute starting with `still`;
    /// the others at debug, starting with `first` too; and, when
    /// `recovered` is given, one info line starting with it. Panics naming
    /// what is off; returns the first failure's line (to check its error).
    pub fn assert_run_of_failures(
        &self,
        failed: u64,
        lasting: std::time::Duration,
        first: &str,
        still: &str,
        recovered: Option<&str>,
    ) -> LogLine {
        use tracing::Level;
        let firsts = self.starting(Level::WARN, first);
        assert_eq!(
            firsts.len(),
            1,
            "the first failure alone at warn: {firsts:?}"
        );
        let stills = self.starting(Level::WARN, still);
        assert!(
            stills.len() as u64 <= lasting.as_secs() / 60,
            "at most one a minute, {lasting:?} of failing: {stills:?}"
        );
        let quiet = self.starting(Level::DEBUG, first);
        assert_eq!(
            quiet.len() as u64,
            failed - 1 - stills.len() as u64,
            "the others of {failed} at debug"
        );
        if let Some(recovered) = recovered {
            let recovery = self.starting(Level::INFO, recovered);
            assert_eq!(recovery.len(), 1, "the recovery once: {recovery:?}");
        }
        firsts.into_iter().next().expect("one")
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for LogLines {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        /// Reads the message and the `error` field of an event.
        struct Fields(String, Option<String>);
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                match field.name() {
                    "message" => self.0 = format!("{value:?}"),
                    "error" => self.1 = Some(format!("{value:?}")),
                    _ => {}
                }
            }
        }
        let mut fields = Fields(String::new(), None);
        event.record(&mut fields);
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(LogLine {
                level: *event.metadata().level(),
                message: fields.0,
                error: fields.1,
            });
    }
}
