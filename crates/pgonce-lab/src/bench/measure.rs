//! Closed-loop load: W workers each run an operation back to back until a
//! deadline; latencies go to an HDR histogram, outcomes to named counters.
//! Shared by every bench suite so figures mean the same everywhere.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};

use crate::report::Row;

/// What one operation reports besides its latency: the name of a counter to
/// bump (`"conflicts"`, `"aborts"`...), or none.
pub(crate) type Outcome = Option<&'static str>;

/// The figures of one measured strategy.
#[derive(Debug, Clone)]
pub(crate) struct Measured {
    pub(crate) ops: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    pub(crate) elapsed: Duration,
    /// Operation latency in microseconds.
    pub(crate) latency: Histogram<u64>,
    pub(crate) counters: BTreeMap<&'static str, u64>,
}

impl Measured {
    pub(crate) fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub(crate) fn quantile_ms(&self, q: f64) -> f64 {
        self.latency.value_at_quantile(q) as f64 / 1000.0
    }

    pub(crate) fn max_ms(&self) -> f64 {
        self.latency.max() as f64 / 1000.0
    }

    /// `ops_per_sec`, `p50_ms`, `p99_ms`, `max_ms`, `errors` and each counter.
    pub(crate) fn row(&self, strategy: &str) -> Row {
        let mut row = Row::new(strategy)
            .with("ops_per_sec", round2(self.ops_per_sec()))
            .with("p50_ms", round2(self.quantile_ms(0.5)))
            .with("p99_ms", round2(self.quantile_ms(0.99)))
            .with("max_ms", round2(self.max_ms()))
            .with("errors", self.errors);
        for (name, n) in &self.counters {
            row.set(name, n);
        }
        row
    }
}

pub(crate) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// A row naming a figure measured over several runs: each run's value and
/// their median.
pub(crate) fn runs_row(name: &str, values: &[f64]) -> Row {
    Row::new(name)
        .with(
            "runs",
            values.iter().map(|v| round2(*v)).collect::<Vec<_>>(),
        )
        .with("median", round2(median(values)))
}

/// The median of `values` (the mean of the middle two for an even count);
/// 0 for none.
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub(crate) fn new_histogram() -> Histogram<u64> {
    // 1 µs to 10 minutes, 3 significant digits.
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

/// Runs `op(worker, iteration)` on `workers` tasks for `duration` and
/// collects latencies and outcomes. An error is counted (the first one kept
/// for the report) and the worker goes on.
pub(crate) async fn closed_loop<F, Fut>(
    label: &str,
    workers: usize,
    duration: Duration,
    op: F,
) -> Measured
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<Outcome>> + Send,
{
    let op = Arc::new(op);
    let progress = progress_bar(label, duration);
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::with_capacity(workers);
    for worker in 0..workers {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut latency = new_histogram();
            let mut counters: BTreeMap<&'static str, u64> = BTreeMap::new();
            let (mut ops, mut errors, mut first_error) = (0u64, 0u64, None);
            let mut iteration = 0u64;
            while Instant::now() < deadline {
                let t = Instant::now();
                match op(worker, iteration).await {
                    Ok(outcome) => {
                        ops += 1;
                        let _ = latency.record(t.elapsed().as_micros().max(1) as u64);
                        if let Some(name) = outcome {
                            *counters.entry(name).or_default() += 1;
                        }
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| format!("{e:#}"));
                    }
                }
                iteration += 1;
            }
            (latency, counters, ops, errors, first_error)
        }));
    }
    let ticker = {
        let progress = progress.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                progress.set_position(started.elapsed().as_millis() as u64);
            }
        })
    };
    let mut measured = Measured {
        ops: 0,
        errors: 0,
        first_error: None,
        elapsed: Duration::ZERO,
        latency: new_histogram(),
        counters: BTreeMap::new(),
    };
    for task in tasks {
        let (latency, counters, ops, errors, first_error) =
            task.await.expect("bench worker panicked");
        measured
            .latency
            .add(&latency)
            .expect("same histogram bounds");
        for (k, v) in counters {
            *measured.counters.entry(k).or_default() += v;
        }
        measured.ops += ops;
        measured.errors += errors;
        if measured.first_error.is_none() {
            measured.first_error = first_error;
        }
    }
    measured.elapsed = started.elapsed();
    ticker.abort();
    progress.finish_and_clear();
    measured
}

/// A bar on stderr for a timed phase; hidden when stderr is not a terminal.
pub(crate) fn progress_bar(label: &str, duration: Duration) -> ProgressBar {
    let bar = ProgressBar::new(duration.as_millis() as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>28} [{bar:30}] {elapsed}/{duration}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(label.to_string());
    bar
}
