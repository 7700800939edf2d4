//! `pgonce bench queue`: messages through a queue, send + receive + delete,
//! with P producers and C consumers, for pgonce's PostgreSQL queue
//! (standard and FIFO with many groups, batch 1 and 10), the raw limit (a
//! one-row INSERT then a one-row DELETE per message, same client count),
//! the raw at-least-once floor (INSERT, a lease, then DELETE: the three
//! commits per message of any queue that survives a consumer's death,
//! with nothing else) and
//! the queue crates from crates.io doing the same work (`peers/`): pgmq,
//! the field's most used PostgreSQL queue, compared shape by shape (batch 1
//! and batch 10, read + delete), and apalis-postgres.
//!
//! Producers stop while more than `BACKLOG` messages are unconsumed, so
//! end-to-end latency measures the queue, not an ever-growing backlog.
//! End-to-end latency: from just before the send to just after the delete,
//! carried in the body as microseconds since the run started. Each row also
//! has the server's WAL per message (`wal_bytes_per_msg`), and
//! `pgonce_wal_vs_pgmq_b1` / `_b10` set pgonce's against pgmq's: a figure
//! of what the statements write, which the machine's other load does not
//! move as it moves throughput.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pgonce::{
    Listen, PgQueue, PgQueueOptions, Queue, QueueAttributes, ReceiveRequest, SendMessage,
};
use sqlx::PgPool;

use super::BenchArgs;
use super::measure::{new_histogram, progress_bar, round2};
use super::peers;
use crate::behind_pooler::bench_listen;
use crate::report::{Report, Row};
use crate::scratch::RunDatabase;

/// Unconsumed messages at which producers pause.
pub(crate) const BACKLOG: i64 = 2000;

/// What one scenario measured.
pub(crate) struct Flow {
    pub(crate) consumed: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    pub(crate) elapsed: Duration,
    /// End-to-end latency, µs.
    pub(crate) latency: Histogram<u64>,
    /// The server's WAL per message consumed in the steady part of the
    /// phase; `None` where the server does not say.
    pub(crate) wal: Option<WalPerMessage>,
}

impl Flow {
    pub(crate) fn per_sec(&self) -> f64 {
        self.consumed as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn row(&self, strategy: &str, shape: &Shape, batch: usize) -> Row {
        let row = Row::new(strategy)
            .with("msgs_per_sec", round2(self.per_sec()))
            .with("ops_per_sec", round2(self.per_sec()))
            .with(
                "p50_ms",
                round2(self.latency.value_at_quantile(0.5) as f64 / 1000.0),
            )
            .with(
                "p99_ms",
                round2(self.latency.value_at_quantile(0.99) as f64 / 1000.0),
            )
            .with("max_ms", round2(self.latency.max() as f64 / 1000.0))
            .with("producers", shape.producers)
            .with("consumers", shape.consumers)
            .with("batch", batch)
            .with("errors", self.errors);
        match self.wal {
            Some(wal) => row.with("wal_bytes_per_msg", round2(wal.bytes)),
            None => row,
        }
    }
}

/// Where the server's write-ahead log was inserting, in bytes from its
/// start, and the messages consumed at that moment. The insert position,
/// not `pg_stat_wal`, whose counters backends report a second or more late.
#[derive(Debug, Clone, Copy)]
struct WalMark {
    position: i64,
    consumed: u64,
}

impl WalMark {
    /// `None` where the server refuses the read (a standby, a role
    /// without the right): the figure is then left out, not guessed.
    async fn read(pool: &PgPool, meter: &Meter) -> Option<WalMark> {
        let consumed = meter.consumed.load(Ordering::Relaxed);
        let position: i64 =
            sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
                .fetch_one(pool)
                .await
                .ok()?;
        Some(WalMark { position, consumed })
    }
}

/// What the server wrote to its write-ahead log per message consumed.
/// Unlike throughput, this does not move with the machine's other load:
/// it says what each queue's statements write for a message (its rows,
/// their index entries, locks and commit records). The server's WAL is
/// the whole cluster's, so it is read on a server running nothing else
/// (the throwaway cluster a run starts by default).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WalPerMessage {
    bytes: f64,
}

impl WalPerMessage {
    fn between(start: Option<WalMark>, end: Option<WalMark>) -> Option<WalPerMessage> {
        let (start, end) = (start?, end?);
        let messages = end
            .consumed
            .checked_sub(start.consumed)
            .filter(|&n| n > 0)? as f64;
        Some(WalPerMessage {
            bytes: (end.position - start.position) as f64 / messages,
        })
    }
}

/// Clients of one scenario.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) producers: usize,
    pub(crate) consumers: usize,
    pub(crate) phase: Duration,
}

/// The shared clock and counters of one scenario.
pub(crate) struct Meter {
    started: Instant,
    deadline: Instant,
    outstanding: AtomicI64,
    consumed: AtomicU64,
    errors: AtomicU64,
    first_error: std::sync::Mutex<Option<String>>,
    latency: std::sync::Mutex<Histogram<u64>>,
}

impl Meter {
    fn new(phase: Duration) -> Arc<Meter> {
        let started = Instant::now();
        Arc::new(Meter {
            started,
            deadline: started + phase,
            outstanding: AtomicI64::new(0),
            consumed: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            first_error: std::sync::Mutex::new(None),
            latency: std::sync::Mutex::new(new_histogram()),
        })
    }

    pub(crate) fn running(&self) -> bool {
        Instant::now() < self.deadline
    }

    /// The body to send now: the send time.
    pub(crate) fn stamp(&self) -> String {
        self.started.elapsed().as_micros().to_string()
    }

    /// Waits while the backlog is full; false once the phase is over.
    pub(crate) async fn may_send(&self, n: usize) -> bool {
        while self.outstanding.load(Ordering::Relaxed) > BACKLOG {
            if !self.running() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.outstanding.fetch_add(n as i64, Ordering::Relaxed);
        self.running()
    }

    /// Records a message consumed (deleted or completed) now.
    pub(crate) fn consumed(&self, body: &str) {
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
        if !self.running() {
            return;
        }
        self.consumed.fetch_add(1, Ordering::Relaxed);
        if let Ok(sent) = body.parse::<u128>() {
            let now = self.started.elapsed().as_micros();
            let _ = self
                .latency
                .lock()
                .unwrap()
                .record(now.saturating_sub(sent).max(1) as u64);
        }
    }

    pub(crate) fn error(&self, e: impl std::fmt::Display) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.first_error
            .lock()
            .unwrap()
            .get_or_insert_with(|| e.to_string());
    }

    fn flow(&self) -> Flow {
        Flow {
            consumed: self.consumed.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            first_error: self.first_error.lock().unwrap().clone(),
            elapsed: self.deadline - self.started,
            latency: self.latency.lock().unwrap().clone(),
            wal: None,
        }
    }
}

/// Runs `produce(meter, producer)` and `consume(meter, consumer)` loops
/// (each returns when the meter's phase is over) and collects the figures.
/// The WAL per message is read on `server` over the phase's last four
/// fifths: by then a queue whose consumers fall behind has filled its
/// backlog, so what is sent is what is consumed, and the WAL of messages
/// sent but never consumed does not weigh on the figure.
pub(crate) async fn drive<P, PF, C, CF>(
    label: &str,
    shape: Shape,
    server: &PgPool,
    produce: P,
    consume: C,
) -> Flow
where
    P: Fn(Arc<Meter>, usize) -> PF,
    PF: Future<Output = ()> + Send + 'static,
    C: Fn(Arc<Meter>, usize) -> CF,
    CF: Future<Output = ()> + Send + 'static,
{
    let meter = Meter::new(shape.phase);
    let progress = progress_bar(label, shape.phase);
    let mut tasks = Vec::new();
    for c in 0..shape.consumers {
        tasks.push(tokio::spawn(consume(meter.clone(), c)));
    }
    for p in 0..shape.producers {
        tasks.push(tokio::spawn(produce(meter.clone(), p)));
    }
    let mut wal_start = None;
    while meter.running() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let elapsed = meter.started.elapsed();
        progress.set_position(elapsed.as_millis() as u64);
        if wal_start.is_none() && elapsed >= shape.phase / 5 {
            wal_start = Some(WalMark::read(server, &meter).await);
        }
    }
    let wal_end = WalMark::read(server, &meter).await;
    // Loops notice the end at their next step; a long poll may take up to
    // its wait, so give them a bound and then drop them.
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(3), t).await;
    }
    progress.finish_and_clear();
    let mut flow = meter.flow();
    flow.wal = WalPerMessage::between(wal_start.flatten(), wal_end);
    flow
}

#[derive(Clone, Copy)]
struct PgScenario {
    fifo: bool,
    batch: usize,
    groups: usize,
    notify: bool,
}

pub(crate) async fn run(args: &BenchArgs, db: &RunDatabase) -> anyhow::Result<Report> {
    let shape = Shape {
        producers: if args.quick { 2 } else { 4 },
        consumers: if args.quick { 4 } else { 8 },
        phase: args.phase(),
    };
    sqlx::raw_sql(include_str!("sql/queue_schema.sql"))
        .execute(db.pool())
        .await?;
    let mut report = Report::new("bench", "queue", db.environment().await?);
    let (listen, listen_off) = bench_listen(db.pool()).await?;
    let scenarios = [
        (
            "pgonce-standard-b1",
            PgScenario {
                fifo: false,
                batch: 1,
                groups: 0,
                notify: true,
            },
        ),
        (
            "pgonce-standard-b10",
            PgScenario {
                fifo: false,
                batch: 10,
                groups: 0,
                notify: true,
            },
        ),
        (
            "pgonce-standard-b1-no-notify",
            PgScenario {
                fifo: false,
                batch: 1,
                groups: 0,
                notify: false,
            },
        ),
        (
            "pgonce-standard-b10-no-notify",
            PgScenario {
                fifo: false,
                batch: 10,
                groups: 0,
                notify: false,
            },
        ),
        (
            "pgonce-fifo-1000-groups-b10",
            PgScenario {
                fifo: true,
                batch: 10,
                groups: 1000,
                notify: true,
            },
        ),
    ];
    let mut ours = Vec::new();
    for (i, (strategy, scenario)) in scenarios.into_iter().enumerate() {
        let flow = pg_queue(
            db.pool(),
            &format!("bench{i}"),
            shape,
            scenario,
            listen.clone(),
        )
        .await?;
        check(&mut report, strategy, &flow);
        report
            .results
            .push(flow.row(strategy, &shape, scenario.batch));
        ours.push((strategy, scenario, flow.per_sec()));
    }

    let raw = drive(
        "raw-insert-delete",
        shape,
        db.pool(),
        raw_produce(db.pool(), include_str!("sql/queue_raw_insert.sql")),
        raw_consume(db.pool(), take_and_delete),
    )
    .await;
    check(&mut report, "raw-insert-delete", &raw);
    report.results.push(raw.row("raw-insert-delete", &shape, 1));
    let raw_lease = drive(
        "raw-insert-lease-delete",
        shape,
        db.pool(),
        raw_produce(db.pool(), include_str!("sql/queue_raw_lease_insert.sql")),
        raw_consume(db.pool(), lease_then_delete),
    )
    .await;
    check(&mut report, "raw-insert-lease-delete", &raw_lease);
    report
        .results
        .push(raw_lease.row("raw-insert-lease-delete", &shape, 1));

    let mut peer_rates = Vec::new();
    // apalis-postgres LISTENs on its pool's connections, which only works
    // where sessions survive.
    let with_listen = listen_off.is_none();
    for (strategy, batch, flow) in peers::queue_peers(db, shape, with_listen).await? {
        check(&mut report, &strategy, &flow);
        report.results.push(flow.row(&strategy, &shape, batch));
        peer_rates.push((strategy, flow.per_sec()));
    }
    let peer_rate = |name: &str| {
        peer_rates
            .iter()
            .find(|(s, _)| s == name)
            .map(|(_, r)| *r)
            .unwrap_or(0.0)
    };

    // pgmq shape by shape: same batch, same visibility timeout, receive
    // then delete on both sides (at-least-once).
    for (ratio, ours_i, peer) in [
        ("pgonce_vs_pgmq_b1", 0, "pgmq-b1"),
        ("pgonce_vs_pgmq_b10", 1, "pgmq-b10"),
    ] {
        report.ratio(ratio, ours[ours_i].2, peer_rate(peer));
        report.ratio_goal(ratio, 1.2).note = Some(format!("{} against {peer}", ours[ours_i].0));
    }
    // What each writes to the server's WAL per message, in the same
    // shapes: pgonce's over pgmq's (below 1: pgonce writes less).
    let wal_of = |report: &Report, strategy: &str| {
        report
            .results
            .iter()
            .find(|row| row.text("strategy").as_deref() == Some(strategy))
            .and_then(|row| row.number("wal_bytes_per_msg"))
    };
    for (ratio, ours_i, peer) in [
        ("pgonce_wal_vs_pgmq_b1", 0, "pgmq-b1"),
        ("pgonce_wal_vs_pgmq_b10", 1, "pgmq-b10"),
    ] {
        let (a, b) = (wal_of(&report, ours[ours_i].0), wal_of(&report, peer));
        if let (Some(a), Some(b)) = (a, b) {
            report.ratio(ratio, a, b);
        }
    }
    // Batch 1 with neither side pushing wake-ups: pgmq's consumers poll
    // (the bench sleeps 1 ms after an empty read), pgonce's without
    // notifications poll at their 50 ms interval. Against
    // pgonce_vs_pgmq_b1, the difference is what waking receivers at once
    // costs in throughput (and buys in latency).
    let rate_of = |name: &str| {
        ours.iter()
            .find(|(strategy, _, _)| *strategy == name)
            .map(|(_, _, rate)| *rate)
            .unwrap_or(0.0)
    };
    let polling_b1 = rate_of("pgonce-standard-b1-no-notify");
    report.ratio(
        "pgonce_no_notify_vs_pgmq_b1",
        polling_b1,
        peer_rate("pgmq-b1"),
    );
    report.ratio("pgonce_no_notify_b1_vs_raw", polling_b1, raw.per_sec());

    // pgmq's pop deletes as it reads (at-most-once): a guarantee pgonce's
    // queue does not trade away, so it is set against the raw limit only.
    report.ratio(
        "pgmq_pop_b1_vs_raw",
        peer_rate("pgmq-pop-b1"),
        raw.per_sec(),
    );
    report.ratio("pgmq_b1_vs_raw", peer_rate("pgmq-b1"), raw.per_sec());

    // Like for like: the raw limit is one message per statement, so it is
    // compared with pgonce at batch 1; peers are compared with pgonce's best
    // standard configuration against their best.
    let b1 = ours[0].2;
    let best_ours = ours
        .iter()
        .filter(|(_, s, _)| !s.fifo)
        .map(|o| o.2)
        .fold(0.0, f64::max);
    report.ratio("pgonce_b1_vs_raw", b1, raw.per_sec());
    report.ratio_goal("pgonce_b1_vs_raw", 0.5);
    if let Some((peer, rate)) = peer_rates
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .cloned()
    {
        report.ratio("pgonce_vs_best_peer", best_ours, rate);
        report.ratio_goal("pgonce_vs_best_peer", 1.2).note =
            Some(format!("pgonce's best standard shape against {peer}"));
    }
    report.ratio("pgonce_best_vs_raw", best_ours, raw.per_sec());
    // The raw limit takes and deletes a message in one statement: a
    // consumer that dies after it loses the message. Delivering at least
    // once takes a lease first, a commit more per message; against that
    // floor, what is left is the price of pgonce's own work (receipt
    // fencing, the dead-letter and retention decisions, deduplication).
    report.ratio("raw_lease_vs_raw", raw_lease.per_sec(), raw.per_sec());
    report.ratio("pgonce_b1_vs_raw_lease", b1, raw_lease.per_sec());
    report.ratio(
        "pgonce_no_notify_b1_vs_raw_lease",
        polling_b1,
        raw_lease.per_sec(),
    );
    report.ratio(
        "pgmq_b1_vs_raw_lease",
        peer_rate("pgmq-b1"),
        raw_lease.per_sec(),
    );
    if let Some(reason) = listen_off {
        report.sections.insert(
            "skipped behind a transaction-mode pooler".into(),
            vec![
                Row::new("pgonce LISTEN").with("reason", reason),
                Row::new("apalis-postgres").with(
                    "reason",
                    "it LISTENs on its pool's connections, which a transaction-mode pooler \
                     hands to other clients",
                ),
            ],
        );
    }
    Ok(report)
}

/// The verdict's lines for one scenario: no errors (a violation), and
/// something consumed in the phase: nothing consumed leaves nothing
/// measured, a run that could not finish (a machine too busy to get to
/// it), not a violation.
fn check(report: &mut Report, strategy: &str, flow: &Flow) {
    report.verdict.check(
        flow.errors == 0,
        format!(
            "{strategy}: {} errors{}",
            flow.errors,
            flow.first_error
                .as_ref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        ),
    );
    report.verdict.finished(
        flow.consumed > 0,
        format!("{strategy}: {} consumed in the phase", flow.consumed),
    );
}

async fn pg_queue(
    pool: &PgPool,
    name: &str,
    shape: Shape,
    s: PgScenario,
    listen: Listen,
) -> anyhow::Result<Flow> {
    let attributes = QueueAttributes {
        fifo: s.fifo,
        ..QueueAttributes::default()
    };
    let options = PgQueueOptions {
        notify: s.notify,
        poll_interval: Duration::from_millis(50),
        listen,
    };
    let q = PgQueue::create(pool, name, attributes, options).await?;
    let label = format!("{name} b{}", s.batch);
    let seq = Arc::new(AtomicU64::new(0));
    let produce = {
        let q = q.clone();
        move |m: Arc<Meter>, _p: usize| {
            let (q, seq) = (q.clone(), seq.clone());
            async move {
                while m.may_send(s.batch).await {
                    let batch: Vec<SendMessage> = (0..s.batch)
                        .map(|_| {
                            let msg = SendMessage::new(m.stamp());
                            if s.fifo {
                                let g = seq.fetch_add(1, Ordering::Relaxed) as usize % s.groups;
                                msg.group(format!("g{g}"))
                            } else {
                                msg
                            }
                        })
                        .collect();
                    let sent = if s.batch == 1 {
                        q.send(batch.into_iter().next().unwrap()).await.map(|_| ())
                    } else {
                        q.send_batch(batch).await.map(|_| ())
                    };
                    if let Err(e) = sent {
                        m.error(e);
                    }
                }
            }
        }
    };
    let consume = {
        let q = q.clone();
        move |m: Arc<Meter>, _c: usize| {
            let q = q.clone();
            async move {
                while m.running() {
                    let request = ReceiveRequest::up_to(s.batch).wait(Duration::from_millis(500));
                    match q.receive(request).await {
                        Ok(got) if got.is_empty() => {}
                        Ok(got) => {
                            let receipts: Vec<_> = got.iter().map(|r| r.receipt.clone()).collect();
                            let deleted = if receipts.len() == 1 {
                                q.delete(&receipts[0]).await.map(|()| Vec::new())
                            } else {
                                q.delete_batch(&receipts).await
                            };
                            match deleted {
                                Ok(stale) if stale.is_empty() => {
                                    got.iter().for_each(|r| m.consumed(&r.body))
                                }
                                Ok(stale) => m.error(format!("{} stale receipts", stale.len())),
                                Err(e) => m.error(e),
                            }
                        }
                        Err(e) => m.error(e),
                    }
                }
            }
        }
    };
    let flow = drive(&label, shape, pool, produce, consume).await;
    q.purge().await?;
    Ok(flow)
}

/// Producers of a raw floor: `insert` takes the body as its parameter.
fn raw_produce(
    pool: &PgPool,
    insert: &'static str,
) -> impl Fn(Arc<Meter>, usize) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
    let pool = pool.clone();
    move |m, _| {
        let pool = pool.clone();
        Box::pin(async move {
            while m.may_send(1).await {
                if let Err(e) = sqlx::query(insert).bind(m.stamp()).execute(&pool).await {
                    m.error(e);
                }
            }
        })
    }
}

/// Consumers of a raw floor: `take` consumes one message and returns its
/// body, or `None` when there was none to take.
fn raw_consume<T, TF>(
    pool: &PgPool,
    take: T,
) -> impl Fn(Arc<Meter>, usize) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
where
    T: Fn(PgPool) -> TF + Clone + Send + Sync + 'static,
    TF: Future<Output = Result<Option<String>, sqlx::Error>> + Send,
{
    let pool = pool.clone();
    move |m, _| {
        let (pool, take) = (pool.clone(), take.clone());
        Box::pin(async move {
            while m.running() {
                match take(pool.clone()).await {
                    Ok(Some(body)) => m.consumed(&body),
                    // Nothing to take: back off briefly rather than spin.
                    Ok(None) => tokio::time::sleep(Duration::from_millis(1)).await,
                    Err(e) => m.error(e),
                }
            }
        })
    }
}

/// The raw limit's consumer: takes and deletes a message in one statement
/// (a consumer that dies after it has lost the message).
async fn take_and_delete(pool: PgPool) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(include_str!("sql/queue_raw_delete.sql"))
        .fetch_optional(&pool)
        .await
}

/// A row leased by the raw at-least-once floor.
#[derive(sqlx::FromRow)]
struct LeasedRow {
    id: i64,
    body: String,
}

/// The raw at-least-once floor's consumer: leases a message, then deletes
/// it, two statements each committed on its own.
async fn lease_then_delete(pool: PgPool) -> Result<Option<String>, sqlx::Error> {
    let leased: Option<LeasedRow> = sqlx::query_as(include_str!("sql/queue_raw_lease.sql"))
        .fetch_optional(&pool)
        .await?;
    let Some(row) = leased else {
        return Ok(None);
    };
    sqlx::query(include_str!("sql/queue_raw_lease_delete.sql"))
        .bind(row.id)
        .execute(&pool)
        .await?;
    Ok(Some(row.body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Environment, Outcome};

    fn flow(consumed: u64, errors: u64) -> Flow {
        Flow {
            consumed,
            errors,
            first_error: None,
            elapsed: Duration::from_secs(1),
            latency: new_histogram(),
            wal: None,
        }
    }

    /// A queue that consumed nothing in its phase (a machine too busy to
    /// get to it) left nothing measured, the run unfinished; it broke
    /// nothing. An error is a violation.
    #[test]
    fn a_phase_with_nothing_consumed_is_unfinished_not_a_violation() {
        let judged = |flow: Flow| {
            let mut report = Report::new("bench", "queue", Environment::unknown());
            check(&mut report, "pgonce-b1", &flow);
            report.verdict.outcome()
        };
        assert_eq!(judged(flow(10, 0)), Outcome::Ok);
        assert_eq!(judged(flow(0, 0)), Outcome::Unfinished);
        assert_eq!(judged(flow(0, 1)), Outcome::Violated);
        assert_eq!(judged(flow(10, 1)), Outcome::Violated);
    }
}
