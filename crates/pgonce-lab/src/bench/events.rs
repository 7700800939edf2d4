//! `pgonce bench events`: DCB appends under the three strategies, W writers,
//! tag overlap from disjoint (a tag per writer) to fully conflicting (one tag
//! for all). Each operation is a decision read on the writer's tag and an
//! append conditioned on it, as a DCB command handler does.
//!
//! Figures per strategy and overlap: appends/s, p50/p99, `conflicts` (failed
//! conditions: correct refusals, detected before any insert under the lock
//! strategies), `aborts` (attempts PostgreSQL rolled back after doing their
//! work: the wasted work), `retries`, deadlocks (pg_stat_database) and the
//! mean number of backends waiting on a lock (sampled from pg_locks).
//! Appends run without NOTIFY (it serializes commits on one lock in
//! PostgreSQL); one extra row measures the advisory strategy with it.
//!
//! The limit: the same event rows (same table, tags and indexes) inserted
//! by the same writers with no decision read, no condition and no lock, one
//! autocommitted INSERT each (`unconditioned-insert`). Every strategy is
//! reported as a fraction of it (`*_of_unconditioned_*` ratios: committed
//! conditional appends/s over plain inserts/s at the same overlap). A
//! second floor, `read-then-insert` (disjoint tags): the decision read's
//! statement without its lock, then the plain insert, two statements as in
//! a command that reads before it writes; `advisory_locks_of_read_then_insert`
//! is the part of the gap that is the safeguard's. And the guarded write
//! alone, `advisory-locks-kept-decision`: writers that keep their decision
//! between commands (decide once, then condition each append on the
//! position the previous one returned), one conditional append per command.
//!
//! The peer, disintegrate-postgres (`peers/disintegrate.rs`), runs the same
//! workload on its own sqlx 0.8 pool on the same database; the
//! `pgonce_vs_disintegrate_*` ratios compare committed appends/s, pgonce's
//! best strategy against it at the same overlap and writers.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgonce::Error;
use pgonce::events::{AppendCondition, AppendStrategy, Event, EventStore, EventStoreConfig, Query};
use sqlx::PgPool;

use super::BenchArgs;
use super::measure::{Measured, closed_loop, round2};
use super::peers::disintegrate::{self, Peer};
use crate::report::{Report, Row};
use crate::scratch::RunDatabase;

/// Events in the log before the run, on each side.
const SEEDED: i64 = 20_000;

#[derive(Clone, Copy)]
pub(super) enum Overlap {
    /// A tag per writer: no two appends conflict.
    Disjoint,
    /// Four writers per tag.
    Partial,
    /// One tag for every writer.
    Full,
}

impl Overlap {
    fn name(self) -> &'static str {
        match self {
            Overlap::Disjoint => "disjoint",
            Overlap::Partial => "4-per-tag",
            Overlap::Full => "one-tag",
        }
    }

    pub(super) fn tag(self, worker: usize) -> String {
        match self {
            Overlap::Disjoint => format!("bench:{worker}"),
            Overlap::Partial => format!("bench:{}", worker / 4),
            Overlap::Full => "bench:all".into(),
        }
    }
}

/// One measured cell.
struct Cell {
    m: Measured,
    retries: u64,
    aborts: u64,
    deadlocks: i64,
    waiting: f64,
}

pub(crate) async fn run(args: &BenchArgs, db: &RunDatabase) -> anyhow::Result<Report> {
    let workers = 16;
    let phase = if args.quick && args.seconds.is_none() {
        Duration::from_secs_f64(1.0)
    } else {
        args.phase()
    };
    // A log big enough for the planner to use the indexes, as in production.
    sqlx::query(
        "INSERT INTO pgonce.events (type, tags, data)
         SELECT 'Seeded', ARRAY['seed:' || i], 'null' FROM generate_series(1, $1) AS i",
    )
    .bind(SEEDED)
    .execute(db.pool())
    .await?;
    sqlx::query("ANALYZE pgonce.events")
        .execute(db.pool())
        .await?;
    let mut report = Report::new("bench", "events", db.environment().await?);
    let mut cells: Vec<(AppendStrategy, Overlap, Cell)> = Vec::new();
    for overlap in [Overlap::Disjoint, Overlap::Partial, Overlap::Full] {
        for strategy in AppendStrategy::ALL {
            let label = format!("{}/{}", strategy.name(), overlap.name());
            let cell = measure(db.pool(), strategy, false, overlap, workers, phase, &label).await?;
            report
                .results
                .push(row(strategy.name(), overlap, workers, &cell));
            no_errors(&mut report, &label, &cell.m);
            cells.push((strategy, overlap, cell));
        }
    }
    let mut limits: Vec<(Overlap, f64)> = Vec::new();
    for overlap in [Overlap::Disjoint, Overlap::Partial, Overlap::Full] {
        let label = format!("{UNCONDITIONED}/{}", overlap.name());
        let cell = observed(
            db.pool(),
            unguarded(db.pool(), overlap, false, workers, phase, &label),
        )
        .await?;
        report
            .results
            .push(row(UNCONDITIONED, overlap, workers, &cell));
        no_errors(&mut report, &label, &cell.m);
        limits.push((overlap, cell.m.ops_per_sec()));
    }
    for (overlap, limit) in &limits {
        for (strategy, o, cell) in &cells {
            if o.name() == overlap.name() {
                report.ratio(
                    &format!(
                        "{}_of_unconditioned_{}_16w",
                        strategy.name().replace('-', "_"),
                        overlap.name().replace('-', "_")
                    ),
                    committed_per_sec(cell),
                    *limit,
                );
            }
        }
    }
    // The same advisory cell on the transaction path (BEGIN with the locks,
    // check + insert, COMMIT; the decision read likewise): a pool whose
    // sessions default to REPEATABLE READ makes the one-statement functions
    // refuse, and pgonce then takes the path that sets READ COMMITTED itself.
    // Side by side with the one-statement cell above, in one run.
    let transaction_path = sqlx::postgres::PgPoolOptions::new()
        .max_connections(workers as u32 + 4)
        .connect_with(
            db.options()
                .options([("default_transaction_isolation", "repeatable read")]),
        )
        .await?;
    let three_messages = measure(
        &transaction_path,
        AppendStrategy::AdvisoryLocks,
        false,
        Overlap::Disjoint,
        workers,
        phase,
        TRANSACTION_PATH,
    )
    .await?;
    transaction_path.close().await;
    report.results.push(row(
        TRANSACTION_PATH,
        Overlap::Disjoint,
        workers,
        &three_messages,
    ));
    no_errors(&mut report, TRANSACTION_PATH, &three_messages.m);
    if let Some((_, limit)) = limits.first() {
        report.ratio(
            "advisory_locks_transaction_path_of_unconditioned_disjoint_16w",
            committed_per_sec(&three_messages),
            *limit,
        );
    }
    report.ratio(
        "advisory_one_statement_vs_transaction_path_disjoint_16w",
        committed_per_sec(get_cell(&cells, AppendStrategy::AdvisoryLocks, "disjoint")),
        committed_per_sec(&three_messages),
    );

    // The guarded write alone: the advisory strategy with the decision kept
    // by each writer between commands, one conditional append per command.
    let kept = measure_kept_decision(db.pool(), workers, phase, KEPT_DECISION).await?;
    report
        .results
        .push(row(KEPT_DECISION, Overlap::Disjoint, workers, &kept));
    no_errors(&mut report, KEPT_DECISION, &kept.m);
    if let Some((_, limit)) = limits.first() {
        report.ratio(
            "advisory_locks_kept_decision_of_unconditioned_disjoint_16w",
            committed_per_sec(&kept),
            *limit,
        );
    }

    // The same two statements as a DCB command without the safeguard: the
    // decision read's rows with no lock, then the plain insert. The floor a
    // command that reads before it writes cannot go below, whatever guards
    // it: how much of the gap to the one-statement limit is the safeguard's.
    let label = format!("{READ_THEN_INSERT}/disjoint");
    let unguarded = observed(
        db.pool(),
        unguarded(db.pool(), Overlap::Disjoint, true, workers, phase, &label),
    )
    .await?;
    report.results.push(row(
        READ_THEN_INSERT,
        Overlap::Disjoint,
        workers,
        &unguarded,
    ));
    no_errors(&mut report, &label, &unguarded.m);
    if let Some((_, limit)) = limits.first() {
        report.ratio(
            "read_then_insert_of_unconditioned_disjoint_16w",
            unguarded.m.ops_per_sec(),
            *limit,
        );
    }
    report.ratio(
        "advisory_locks_of_read_then_insert_disjoint_16w",
        committed_per_sec(get_cell(&cells, AppendStrategy::AdvisoryLocks, "disjoint")),
        unguarded.m.ops_per_sec(),
    );

    let notify = measure(
        db.pool(),
        AppendStrategy::AdvisoryLocks,
        true,
        Overlap::Disjoint,
        workers,
        phase,
        "advisory-locks+notify/disjoint",
    )
    .await?;
    report.results.push(row(
        "advisory-locks+notify",
        Overlap::Disjoint,
        workers,
        &notify,
    ));

    // The peer on its own pool, same database, same workload, same phases.
    let peer = Peer::open(db, workers as u32 + 4, SEEDED).await?;
    let mut peer_cells: Vec<(Overlap, Cell)> = Vec::new();
    for overlap in [Overlap::Disjoint, Overlap::Partial, Overlap::Full] {
        let label = format!("{}/{}", disintegrate::NAME, overlap.name());
        let observed_cell =
            observed(db.pool(), peer.measure(overlap, workers, phase, &label)).await?;
        let cell = Cell {
            aborts: observed_cell.m.counters.get("aborts").copied().unwrap_or(0),
            ..observed_cell
        };
        report
            .results
            .push(row(disintegrate::NAME, overlap, workers, &cell));
        no_errors(&mut report, &label, &cell.m);
        peer_cells.push((overlap, cell));
    }

    let get = |s: AppendStrategy, o: &str| get_cell(&cells, s, o);
    let adv = get(AppendStrategy::AdvisoryLocks, "disjoint")
        .m
        .ops_per_sec();
    let table = get(AppendStrategy::TableLock, "disjoint").m.ops_per_sec();
    let ssi = get(AppendStrategy::Serializable, "disjoint")
        .m
        .ops_per_sec();
    // Printed, not a goal: two cores cannot make a table lock look slow
    // (docs/events-indexes.md); the goal is against the bare insert.
    report.ratio("advisory_vs_table_lock_disjoint_16w", adv, table);
    report.ratio("serializable_vs_table_lock_disjoint_16w", ssi, table);
    report.ratio(
        "advisory_vs_table_lock_one_tag_16w",
        get(AppendStrategy::AdvisoryLocks, "one-tag")
            .m
            .ops_per_sec(),
        get(AppendStrategy::TableLock, "one-tag").m.ops_per_sec(),
    );
    report.ratio(
        "advisory_notify_vs_advisory_disjoint_16w",
        notify.m.ops_per_sec(),
        adv,
    );
    // Against the peer: committed appends/s (refusals and aborts left out),
    // pgonce's best strategy at each overlap, 16 writers.
    let best = |o: &str| {
        AppendStrategy::ALL
            .into_iter()
            .map(|s| committed_per_sec(get(s, o)))
            .fold(0.0, f64::max)
    };
    let peer_at = |o: &str| {
        peer_cells
            .iter()
            .find(|(po, _)| po.name() == o)
            .map(|(_, c)| committed_per_sec(c))
            .expect("measured")
    };
    report.ratio(
        "pgonce_vs_disintegrate_disjoint_16w",
        best("disjoint"),
        peer_at("disjoint"),
    );
    report.ratio(
        "pgonce_vs_disintegrate_4_per_tag_16w",
        best("4-per-tag"),
        peer_at("4-per-tag"),
    );
    report.ratio(
        "pgonce_vs_disintegrate_one_tag_16w",
        best("one-tag"),
        peer_at("one-tag"),
    );
    report.ratio_goal("advisory_locks_of_unconditioned_disjoint_16w", 0.7);
    report.ratio_goal("pgonce_vs_disintegrate_disjoint_16w", 1.2);
    report.sections.insert(
        "comparison of the three strategies, aspect by aspect, filled with what this run measured"
            .into(),
        comparison(&cells),
    );
    Ok(report)
}

/// The strategy name of the limit: the same rows, no condition, no lock.
const UNCONDITIONED: &str = "unconditioned-insert";

/// The advisory strategy with each writer keeping its decision between
/// commands (disjoint tags only).
const KEPT_DECISION: &str = "advisory-locks-kept-decision";

/// The row a conditional append would write, inserted with no condition
/// and no lock ($1: the tag).
const PLAIN_INSERT: &str =
    "INSERT INTO pgonce.events (type, tags, data) VALUES ('Booked', ARRAY[$1], 'null')";

/// A DCB command's two statements without the safeguard: the decision
/// read's rows (no lock), then the plain insert.
const READ_THEN_INSERT: &str = "read-then-insert";

/// The advisory strategy on its transaction path (three messages per
/// append and per decision read instead of one statement each).
const TRANSACTION_PATH: &str = "advisory-locks-transaction-path";

fn get_cell<'a>(
    cells: &'a [(AppendStrategy, Overlap, Cell)],
    strategy: AppendStrategy,
    overlap: &str,
) -> &'a Cell {
    cells
        .iter()
        .find(|(s, o, _)| *s == strategy && o.name() == overlap)
        .map(|(_, _, c)| c)
        .expect("measured")
}

/// A row of the unguarded decision read: the columns pgonce's decision read
/// returns, decoded the same way.
#[derive(sqlx::FromRow)]
#[expect(dead_code, reason = "decoded as pgonce decodes them, then dropped")]
struct ReadRow {
    head: Option<i64>,
    position: Option<i64>,
    #[sqlx(rename = "type")]
    event_type: Option<String>,
    tags: Option<Vec<String>>,
    data: Option<serde_json::Value>,
    metadata: Option<serde_json::Value>,
}

/// Unguarded writers on this cell's own tags. Each operation is one
/// autocommitted INSERT of the row a conditional append would write (the
/// limit); with `read_first`, the rows the decision read returns for the
/// writer's tag come first (the same statement, without the lock before
/// it), two autocommitted statements as in a command that reads before it
/// writes.
fn unguarded(
    pool: &PgPool,
    overlap: Overlap,
    read_first: bool,
    workers: usize,
    phase: Duration,
    label: &str,
) -> impl Future<Output = Measured> {
    let pool = pool.clone();
    let cell = Arc::new(label.to_owned());
    closed_loop(label, workers, phase, move |worker, _| {
        let (pool, cell) = (pool.clone(), cell.clone());
        async move {
            let tag = format!("{cell}/{}", overlap.tag(worker));
            if read_first {
                let rows: Vec<ReadRow> = sqlx::query_as(
                    "SELECT h.head, e.position, e.type, e.tags, e.data, e.metadata
                     FROM (SELECT max(position) AS head FROM pgonce.events) AS h
                     LEFT JOIN LATERAL (
                         SELECT position, type, tags, data, metadata FROM pgonce.events e
                         WHERE e.tags @> ARRAY[$1]
                     ) AS e ON true
                     ORDER BY e.position",
                )
                .bind(&tag)
                .fetch_all(&pool)
                .await?;
                drop(rows);
            }
            sqlx::query(PLAIN_INSERT).bind(&tag).execute(&pool).await?;
            Ok(None)
        }
    })
}

/// The verdict's line for one cell: correctness needs no errors.
fn no_errors(report: &mut Report, label: &str, m: &Measured) {
    report.verdict.check(
        m.errors == 0,
        format!(
            "{label}: {} errors{}",
            m.errors,
            m.first_error
                .clone()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        ),
    );
}

/// Appends that committed, per second: operations less refused conditions
/// and aborted attempts that were not retried.
fn committed_per_sec(c: &Cell) -> f64 {
    let refused = c.m.counters.get("conflicts").copied().unwrap_or(0)
        + c.m.counters.get("aborts").copied().unwrap_or(0);
    c.m.ops.saturating_sub(refused) as f64 / c.m.elapsed.as_secs_f64().max(1e-9)
}

fn row(strategy: &str, overlap: Overlap, workers: usize, c: &Cell) -> Row {
    c.m.row(strategy)
        .with("overlap", overlap.name())
        .with("workers", workers)
        .with(
            "conflicts",
            c.m.counters.get("conflicts").copied().unwrap_or(0),
        )
        .with("aborts", c.aborts)
        .with("retries", c.retries)
        .with("wasted_attempts", c.aborts)
        .with("deadlocks", c.deadlocks)
        .with("avg_waiting_backends", round2(c.waiting))
        .with("committed_per_sec", round2(committed_per_sec(c)))
}

/// The store every cell appends through: the strategy under test, retries
/// enough that a serialization failure is counted, not reported.
fn bench_store(
    pool: &PgPool,
    strategy: AppendStrategy,
    notify: bool,
) -> pgonce::Result<EventStore> {
    EventStore::new(
        pool.clone(),
        EventStoreConfig {
            strategy,
            notify,
            max_retries: 100,
        },
    )
}

async fn measure(
    pool: &PgPool,
    strategy: AppendStrategy,
    notify: bool,
    overlap: Overlap,
    workers: usize,
    phase: Duration,
    label: &str,
) -> anyhow::Result<Cell> {
    let store = bench_store(pool, strategy, notify)?;
    let retries = Arc::new(AtomicU64::new(0));
    let aborts = Arc::new(AtomicU64::new(0));
    let (r, a) = (retries.clone(), aborts.clone());
    // Tags of this cell only: every strategy starts from tags with no
    // history. (With tags shared across cells, the strategy measured later
    // read the earlier cells' events in every decision and paid for them.)
    let cell = Arc::new(label.to_owned());
    let observed_cell = observed(
        pool,
        closed_loop(label, workers, phase, move |worker, _| {
            let (store, r, a, cell) = (store.clone(), r.clone(), a.clone(), cell.clone());
            async move {
                let tag = format!("{cell}/{}", overlap.tag(worker));
                let query = Query::item(Vec::<String>::new(), [tag.as_str()])?;
                let decision = store.decide(&query).await?;
                let event = Event::new("Booked").tag(&tag);
                match store
                    .append(&[event], Some(&AppendCondition::new(query, decision.after)))
                    .await
                {
                    Ok(appended) => {
                        r.fetch_add(appended.retries as u64, Ordering::Relaxed);
                        a.fetch_add(appended.retries as u64, Ordering::Relaxed);
                        Ok(None)
                    }
                    Err(Error::AppendConditionFailed { .. }) => Ok(Some("conflicts")),
                    Err(e) => {
                        if e.is_retryable() {
                            a.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e.into())
                    }
                }
            }
        }),
    )
    .await?;
    Ok(Cell {
        retries: retries.load(Ordering::Relaxed),
        aborts: aborts.load(Ordering::Relaxed),
        ..observed_cell
    })
}

/// The advisory strategy on disjoint tags with the decision kept by the
/// writer, as a command handler that caches its state does: it decides
/// once, then conditions each append on the position its previous append
/// returned, and decides again only after a refusal (counted in
/// `conflicts`). Nobody else writes a writer's tag, so each command is one
/// conditional append: what the guarded write costs, without the read
/// before it.
async fn measure_kept_decision(
    pool: &PgPool,
    workers: usize,
    phase: Duration,
    label: &str,
) -> anyhow::Result<Cell> {
    let store = bench_store(pool, AppendStrategy::AdvisoryLocks, false)?;
    // Per writer: its kept decision's `after`, or None before its first
    // decision and after a refusal.
    let kept: Arc<Vec<Mutex<Option<Option<i64>>>>> =
        Arc::new((0..workers).map(|_| Mutex::new(None)).collect());
    let cell = Arc::new(label.to_owned());
    observed(
        pool,
        closed_loop(label, workers, phase, move |worker, _| {
            let (store, kept, cell) = (store.clone(), kept.clone(), cell.clone());
            async move {
                let tag = format!("{cell}/{}", Overlap::Disjoint.tag(worker));
                let query = Query::item(Vec::<String>::new(), [tag.as_str()])?;
                let known = *kept[worker].lock().unwrap();
                let after = match known {
                    Some(after) => after,
                    None => store.decide(&query).await?.after,
                };
                let event = Event::new("Booked").tag(&tag);
                match store
                    .append(&[event], Some(&AppendCondition::new(query, after)))
                    .await
                {
                    Ok(appended) => {
                        *kept[worker].lock().unwrap() = Some(appended.positions.last().copied());
                        Ok(None)
                    }
                    Err(Error::AppendConditionFailed { .. }) => {
                        *kept[worker].lock().unwrap() = None;
                        Ok(Some("conflicts"))
                    }
                    Err(e) => Err(e.into()),
                }
            }
        }),
    )
    .await
}

/// Runs `load` while sampling how many backends wait on a lock (pg_locks,
/// every 10 ms); returns its cell: its figures, the deadlocks it caused and
/// the mean number of waiting backends, with no retries or aborts counted
/// (a caller that counts them sets them).
async fn observed(pool: &PgPool, load: impl Future<Output = Measured>) -> anyhow::Result<Cell> {
    let deadlocks_before = deadlocks(pool).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (pool, stop) = (pool.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut sum, mut n) = (0i64, 0i64);
            while !stop.load(Ordering::Relaxed) {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(DISTINCT pid) FROM pg_locks WHERE NOT granted",
                )
                .fetch_one(&pool)
                .await
                .unwrap_or(0);
                sum += waiting;
                n += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            sum as f64 / n.max(1) as f64
        })
    };
    let m = load.await;
    stop.store(true, Ordering::Relaxed);
    let waiting = sampler.await.unwrap_or(0.0);
    Ok(Cell {
        m,
        retries: 0,
        aborts: 0,
        deadlocks: deadlocks(pool).await? - deadlocks_before,
        waiting,
    })
}

async fn deadlocks(pool: &PgPool) -> anyhow::Result<i64> {
    // The statistics are flushed at transaction end; good enough for a delta.
    Ok(sqlx::query_scalar(
        "SELECT COALESCE(deadlocks, 0) FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await?)
}

fn comparison(cells: &[(AppendStrategy, Overlap, Cell)]) -> Vec<Row> {
    let cell = |s: AppendStrategy, o: &str| get_cell(cells, s, o);
    let per = |f: &dyn Fn(AppendStrategy) -> String, aspect: &str| {
        let mut row = Row::new(aspect);
        for s in AppendStrategy::ALL {
            row.set(s.name(), f(s));
        }
        row
    };
    let granularity = |s| {
        match s {
            AppendStrategy::Serializable => {
                "none: predicate locks (SIREAD) on the index ranges read"
            }
            AppendStrategy::TableLock => "the whole table (EXCLUSIVE)",
            AppendStrategy::AdvisoryLocks => "per tag (type-only: per type; match-all: one key)",
        }
        .to_string()
    };
    let parallelism = |s| {
        let d = cell(s, "disjoint");
        let o = cell(s, "one-tag");
        format!(
            "disjoint: {:.0} appends/s, {:.1} backends waiting; one tag: {:.0}/s",
            d.m.ops_per_sec(),
            d.waiting,
            o.m.ops_per_sec()
        )
    };
    let detection = |s: AppendStrategy| {
        let o = cell(s, "one-tag");
        let conflicts = o.m.counters.get("conflicts").copied().unwrap_or(0);
        match s {
            AppendStrategy::Serializable => format!(
                "at check or commit (40001): one tag: {} aborts, {} retries, then {conflicts} failed conditions",
                o.aborts, o.retries
            ),
            _ => format!(
                "before insert, under the lock: one tag: {conflicts} failed conditions, {} aborts",
                o.aborts
            ),
        }
    };
    let wasted = |s| {
        let total: u64 = cells
            .iter()
            .filter(|(cs, _, _)| *cs == s)
            .map(|(_, _, c)| c.aborts)
            .sum();
        let ops: u64 = cells
            .iter()
            .filter(|(cs, _, _)| *cs == s)
            .map(|(_, _, c)| c.m.ops)
            .sum();
        format!("{total} attempts rolled back after their work ({ops} appends in all)")
    };
    let deadlock = |s| {
        let total: i64 = cells
            .iter()
            .filter(|(cs, _, _)| *cs == s)
            .map(|(_, _, c)| c.deadlocks)
            .sum();
        let how = match s {
            AppendStrategy::Serializable => "no lock waits of its own",
            AppendStrategy::TableLock => "one lock",
            AppendStrategy::AdvisoryLocks => "keys taken in ascending order, one statement",
        };
        format!("{total} deadlocks observed ({how})")
    };
    let wait = |s| {
        let d = cell(s, "disjoint");
        let o = cell(s, "one-tag");
        format!(
            "disjoint: p99 {:.1} ms, {:.1} waiting; one tag: p99 {:.1} ms, {:.1} waiting",
            d.m.quantile_ms(0.99),
            d.waiting,
            o.m.quantile_ms(0.99),
            o.waiting
        )
    };
    vec![
        per(&granularity, "lock granularity"),
        per(&parallelism, "writer parallelism"),
        per(&detection, "conflict detection"),
        per(&wasted, "wasted work"),
        per(&deadlock, "deadlock risk"),
        per(&wait, "lock wait"),
    ]
}
