//! Catch-up subscription: every event after a position, in position order,
//! never skipping one that commits late with a lower position.
//!
//! # The horizon
//!
//! A position is drawn at insert and becomes visible at commit, so a reader
//! may see 7 before 6 commits. The reader therefore keeps a *horizon* `h`:
//! every position at or below `h` is final (committed and delivered, or never
//! to appear). Each poll, in one REPEATABLE READ snapshot `S`, it reads the
//! visible positions above `h` and advances over them while they are
//! consecutive. At a gap below a visible position `q` it may only pass once
//! no transaction that could still fill the gap is running:
//!
//! * every append assigns its transaction id (`pg_current_xact_id()`, in
//!   `locks.sql`) before it draws a position;
//! * a transaction holding a gap position `p < q` drew `p` before `q` was
//!   drawn, so it had its id before `q` committed, before `S` was taken;
//! * when it first sees the gap, the reader takes a transaction id `R` of
//!   its own, after `S`: every possible holder has an id below `R`;
//! * once a later snapshot has `xmin >= R` (and `R` has ended), every
//!   transaction below `R` has ended, and what that snapshot shows below `q`
//!   is all there will ever be; the rest are rolled-back positions.
//!
//! (`pg_snapshot_xmax` is one past the last *completed* id, not the next id
//! to assign, so a running transaction can sit at or above it: neither
//! `xmax` nor `xmin = xmax` proves that nothing is running. The reader's own
//! id is the bound that does.) An id is taken only when a new gap is seen.
//!
//! So a subscription runs on the primary: a standby cannot give out a
//! transaction id, and a poll that meets a gap there fails. And what it
//! delivers is as durable as the appends: one committed with
//! `synchronous_commit = off` may be delivered, then lost with a crash.
//!
//! A crash can take the bound back. The reader's transaction writes
//! nothing, so PostgreSQL commits it without waiting for the WAL flush,
//! and recovery hands out again the ids after the last one the WAL it
//! replayed names: after a restart `R` may not have ended in any later
//! snapshot, or be handed to someone else, and `xmin` stays below it until
//! that many ids have been used. On an idle server the subscription then
//! waited at the gap, holding back events committed before the crash,
//! until some other transaction took an id. So a gap whose bound a
//! snapshot does not count as ended (`xmax <= R`) is seen as new: the
//! reader takes a new id after that snapshot, which the argument above
//! makes a bound again (the transactions of before the crash that could
//! fill the gap have ended, or, prepared, have ids the WAL names, below
//! it).
//!
//! The events delivered are the query's matching events in `(h_old, h_new]`,
//! read in the same snapshot. A gap holds the subscription until every
//! transaction that had a transaction id when the gap was seen has ended:
//! `xmin` is the whole server's, not only the appends'. So one session left
//! idle in a transaction that has written anything (in any database of the
//! server) holds every subscriber at its next hole (a rolled-back or
//! retried append) until that transaction ends. Nothing is lost or
//! reordered, only delayed; `idle_in_transaction_session_timeout` bounds
//! it. Rows inserted into `pgonce.events` by
//! anything other than [`crate::EventStore`] must follow the same rule (id
//! before position).
//!
//! # Failures in the middle of a poll
//!
//! A poll works out the new horizon (and any new gap) on copies, reads the
//! batch, commits, and only then stores the copies and returns the events,
//! with no await in between. So whatever stops a poll after its snapshot (a
//! cut connection, a server restart, a dropped future), the subscription
//! and [`Subscription::horizon`] still stand where the last returned batch
//! left them: the next poll, or a subscription created with `after` set to
//! `horizon()`, reads the same positions again. Nothing is lost and, since
//! the horizon only moves together with the events handed out, nothing is
//! handed out twice. Reading again is safe because positions at or below
//! the old horizon were final before and everything above it is judged
//! afresh in the new snapshot; a gap's bound taken by a failed poll is
//! dropped with it (the next poll that sees the gap takes a new id, which
//! is only later, so still a bound).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgNotification};

use super::NOTIFY_CHANNEL;
use super::model::{Query, StoredEvent};
use super::query::Filter;
use super::read::EventRow;
use crate::error::{Error, Result};
use crate::listen::Listen;
use crate::service::{Failure, Failures};

/// Settings of a [`Subscription`].
#[derive(Debug, Clone)]
pub struct SubscriptionConfig {
    /// Deliver events after this position. Default 0 (from the start).
    /// To resume, give a subscription's [`Subscription::horizon`], which
    /// is final. Not [`EventStore::head`](super::EventStore::head): an
    /// append in flight may hold a position below the head and commit
    /// after it was read, and a subscription starting at the head never
    /// delivers it.
    pub after: i64,
    /// Which events to deliver. Default [`Query::All`].
    pub query: Query,
    /// Positions examined per poll. Default 1000; at least 1.
    pub batch: i64,
    /// Longest wait for a NOTIFY before polling anyway (the fallback when
    /// notifications are lost or disabled). Default 1 s; 1 ms to
    /// [`MAX_WAIT`](crate::queue::MAX_WAIT).
    pub poll_interval: Duration,
    /// Wait before looking again while a gap is open (its appends still
    /// running; no NOTIFY announces a rollback). Default 5 ms; 1 ms to
    /// [`MAX_WAIT`](crate::queue::MAX_WAIT).
    pub gap_recheck: Duration,
    /// Where to LISTEN for the store's NOTIFY (see [`Listen`]). Default: a
    /// connection like the pool's.
    pub listen: Listen,
}

impl Default for SubscriptionConfig {
    fn default() -> Self {
        SubscriptionConfig {
            after: 0,
            query: Query::All,
            batch: 1000,
            poll_interval: Duration::from_secs(1),
            gap_recheck: Duration::from_millis(5),
            listen: Listen::Pool,
        }
    }
}

impl SubscriptionConfig {
    fn validate(&self) -> Result<()> {
        self.query.validate()?;
        let bad = |why: &str| {
            Err(Error::Invalid {
                what: "subscription config",
                why: why.into(),
            })
        };
        if self.batch < 1 {
            return bad("batch must be at least 1");
        }
        if self.after < 0 {
            return bad("after must not be negative");
        }
        // Shorter than a millisecond, a wait is a busy loop of snapshots;
        // longer than the queue's longest wait, it never comes round.
        for (what, interval) in [
            ("subscription config poll_interval", self.poll_interval),
            ("subscription config gap_recheck", self.gap_recheck),
        ] {
            crate::duration::check_within(
                what,
                interval,
                Duration::from_millis(1),
                crate::queue::MAX_WAIT,
            )?;
        }
        Ok(())
    }
}

/// A gap seen below `upper`; every transaction that could fill it has an id
/// below `bound` (the reader's own id, taken when it saw the gap).
#[derive(Debug, Clone, Copy)]
struct Gap {
    upper: i64,
    bound: i64,
}

/// A point inside [`Subscription::run_once`] where a test hook runs
/// ([`Subscription::set_poll_hook`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PollPoint {
    /// The snapshot was taken (the horizon query ran); nothing read yet.
    AfterSnapshot,
    /// The batch was read; the transaction is about to commit.
    BeforeCommit,
}

/// A test hook: called with the point and the poll's backend pid, and
/// awaited before the poll goes on (to cut the connection there, or to
/// stall so the caller drops the poll).
#[doc(hidden)]
pub type PollHook = Box<
    dyn FnMut(PollPoint, i32) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send,
>;

/// What horizon.sql returns.
#[derive(Debug, sqlx::FromRow)]
struct HorizonRow {
    xmin: i64,
    xmax: i64,
    positions: Vec<i64>,
}

/// What one [`Subscription::run_once`] read, and what it did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct PollOutcome {
    /// The events delivered, in position order; possibly none.
    pub events: Vec<StoredEvent>,
    /// How far the poll moved.
    pub counters: PollCounters,
}

/// What one [`Subscription::run_once`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PollCounters {
    /// Events delivered (matching the query).
    pub delivered: usize,
    /// Positions the horizon moved over (matching or not, plus gaps).
    pub advanced: i64,
    /// Whether it stopped at a gap that may still fill.
    pub waiting_on_gap: bool,
}

/// A catch-up reader (see the module docs for the ordering guarantee).
pub struct Subscription {
    pool: PgPool,
    config: SubscriptionConfig,
    filter: Filter,
    horizon: i64,
    gap: Option<Gap>,
    listener: Option<Receiving>,
    /// The listener's failed reconnects going on, if any (logged as
    /// [`crate::service`] tells of failed passes).
    failing: Failures,
    hook: Option<PollHook>,
}

impl Subscription {
    /// A subscription reading from just above [`SubscriptionConfig::after`].
    /// [`Error::Invalid`] for a bad config; with [`Listen`](crate::Listen)
    /// on, connects its listener now, so an unreachable server fails here.
    pub async fn new(pool: PgPool, config: SubscriptionConfig) -> Result<Subscription> {
        config.validate()?;
        let listener = config.listen.listener(&pool, NOTIFY_CHANNEL).await?;
        Ok(Subscription {
            filter: Filter::new(&config.query, 3),
            horizon: config.after,
            gap: None,
            pool,
            config,
            listener: listener.map(receive),
            failing: Failures::default(),
            hook: None,
        })
    }

    /// Installs (or, with `None`, removes) a hook run at each
    /// [`PollPoint`] of every poll. For fault-injection tests only.
    #[doc(hidden)]
    pub fn set_poll_hook(&mut self, hook: Option<PollHook>) {
        self.hook = hook;
    }

    async fn run_hook(
        &mut self,
        point: PollPoint,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<()> {
        if let Some(hook) = &mut self.hook {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut **tx)
                .await?;
            hook(point, pid).await;
        }
        Ok(())
    }

    /// Every position at or below this is final and was delivered if it
    /// matched (returned by a poll that completed: a failed or dropped poll
    /// leaves it unchanged). A subscription created with `after` set to it
    /// goes on with the next event, missing none.
    pub fn horizon(&self) -> i64 {
        self.horizon
    }

    /// One poll: the next events, possibly none. Never waits for a NOTIFY.
    ///
    /// The horizon and the open gap move only once the batch is read and
    /// its transaction committed, right before the events are returned: a
    /// poll that fails (the connection cut, the server restarted) or is
    /// dropped at any await leaves them where they were, so the next poll,
    /// or a subscription resumed from [`Subscription::horizon`], reads the
    /// same positions again and no event is lost.
    pub async fn run_once(&mut self) -> Result<PollOutcome> {
        let mut tx = crate::begin(&self.pool, crate::IsolationLevel::RepeatableRead).await?;
        let HorizonRow {
            xmin,
            xmax,
            positions,
        } = sqlx::query_as(include_str!("sql/horizon.sql"))
            .bind(self.horizon)
            .bind(self.config.batch)
            .fetch_one(&mut *tx)
            .await?;
        self.run_hook(PollPoint::AfterSnapshot, &mut tx).await?;
        // Worked out on copies; stored only after the commit below.
        let old = self.horizon;
        let mut horizon = self.horizon;
        // A bound this snapshot does not count as ended was lost with a
        // crash (module docs): the gap is seen afresh, with a new bound.
        let mut gap = self.gap.filter(|g| g.bound < xmax);
        let mut waiting = false;
        let mut new_gap = None;
        for p in positions {
            if p != horizon + 1 {
                let settled = gap.is_some_and(|g| p <= g.upper && xmin >= g.bound);
                if !settled {
                    if gap.is_none() {
                        new_gap = Some(p);
                    }
                    waiting = true;
                    break;
                }
            }
            horizon = p;
            if gap.is_some_and(|g| p >= g.upper) {
                gap = None;
            }
        }
        if let Some(upper) = new_gap {
            let bound: i64 = sqlx::query_scalar(include_str!("sql/own_xid.sql"))
                .fetch_one(&mut *tx)
                .await?;
            gap = Some(Gap { upper, bound });
        }
        let events = if horizon > old {
            let rows: Vec<EventRow> = self
                .filter
                .bind_as(
                    sqlx::query_as(self.filter.statement(include_str!("sql/range.sql")))
                        .bind(old)
                        .bind(horizon),
                )
                .fetch_all(&mut *tx)
                .await?;
            rows.into_iter().map(StoredEvent::from).collect()
        } else {
            Vec::new()
        };
        self.run_hook(PollPoint::BeforeCommit, &mut tx).await?;
        tx.commit().await?;
        // No await from here on: the state moves with the events returned.
        self.horizon = horizon;
        self.gap = gap;
        let counters = PollCounters {
            delivered: events.len(),
            advanced: horizon - old,
            waiting_on_gap: waiting,
        };
        Ok(PollOutcome { events, counters })
    }

    /// Waits until at least one event can be delivered, and returns the
    /// next batch. Woken by NOTIFY, with polling as the fallback. A
    /// listener that lost its connection and cannot get a new one polls
    /// at `poll_interval`; its failed reconnects count in
    /// `pgonce_events_subscription_failed_reconnects_total` and are logged
    /// as [`crate::service`] logs failed passes: the first at warn, then a
    /// warn line a minute at most, and one info line once a notification
    /// or a reconnect shows it connected again.
    pub async fn next(&mut self) -> Result<Vec<StoredEvent>> {
        loop {
            let PollOutcome { events, counters } = self.run_once().await?;
            if !events.is_empty() {
                return Ok(events);
            }
            if counters.advanced > 0 {
                continue;
            }
            let wait = if counters.waiting_on_gap {
                self.config.gap_recheck
            } else {
                self.config.poll_interval
            };
            match &mut self.listener {
                Some(receiving) if !counters.waiting_on_gap => {
                    // A notification, the timeout, or a listener that lost
                    // its connection and LISTENs again on a new one
                    // (`Ok(None)`: what was notified meanwhile is lost):
                    // each time, look again. A listener that cannot get a
                    // new connection fails at once on every attempt; then
                    // wait out the interval as for a notification, or each
                    // poll would follow the last without a pause. The
                    // timeout leaves the receive where it is (see
                    // `Receiving`).
                    let until = tokio::time::Instant::now() + wait;
                    let Ok((listener, received)) =
                        tokio::time::timeout(wait, receiving.as_mut()).await
                    else {
                        continue;
                    };
                    // Finished: never polled again; the next receive
                    // takes its place before any other await.
                    *receiving = receive(listener);
                    match received {
                        Err(e) => {
                            failed_reconnect(&mut self.failing, &e);
                            tokio::time::sleep_until(until).await;
                        }
                        // A notification or a reconnect: it has a connection
                        // again. (A timeout tells nothing of it.)
                        Ok(_) => {
                            if let Some(run) = self.failing.succeeded() {
                                tracing::info!(failed = run.count, since = %run.since,
                                    "subscription listener reconnected after {} failed reconnects since {}",
                                    run.count, run.since);
                            }
                        }
                    }
                }
                _ => tokio::time::sleep(wait).await,
            }
        }
    }

    /// Delivers batches to `handle` until `shutdown` resolves.
    pub async fn run<F>(
        &mut self,
        mut handle: F,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<()>
    where
        F: FnMut(Vec<StoredEvent>),
    {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                batch = self.next() => handle(batch?),
            }
        }
    }
}

/// The listener's wait for its next notification, kept across polls.
///
/// After a lost connection, that wait is also where the listener connects
/// again and LISTENs (`try_recv`). [`Subscription::next`] waits at most a
/// poll interval for it, then polls: were the receive dropped at each
/// timeout, a reconnect slower than the interval (a busy server, a
/// distant one, TLS) would start over every time and never finish, and
/// the subscription would poll without a listener for good. Kept, it goes
/// on where it stopped at the next wait. A notification that comes while
/// a poll runs is read at the next wait, which then ends at once: one poll
/// more, nothing missed. The future owns the listener and hands it back
/// with what it received.
type Receiving =
    Pin<Box<dyn Future<Output = (PgListener, Result<Option<PgNotification>, sqlx::Error>)> + Send>>;

/// The next receive of `listener` (not started until polled).
fn receive(mut listener: PgListener) -> Receiving {
    Box::pin(async move {
        let received = listener.try_recv().await;
        (listener, received)
    })
}

/// Counts a listener's failed reconnect in
/// `pgonce_events_subscription_failed_reconnects_total` and logs it: the
/// first of a run at warn with its error, then a warn line a minute at
/// most while they go on, the others at debug.
fn failed_reconnect(failing: &mut Failures, error: &sqlx::Error) {
    metrics::counter!("pgonce_events_subscription_failed_reconnects_total").increment(1);
    match failing.failed(tokio::time::Instant::now(), time::OffsetDateTime::now_utc()) {
        Failure::First => tracing::warn!(error = %error,
            "subscription listener cannot reconnect; polling at poll_interval"),
        Failure::StillFailing(run) => {
            tracing::warn!(failed = run.count, since = %run.since, error = %error,
            "subscription listener still cannot reconnect: {} reconnects failed since {}; polling at poll_interval",
            run.count, run.since)
        }
        Failure::Quiet => tracing::debug!(error = %error,
            "subscription listener cannot reconnect; polling at poll_interval"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait shorter than a millisecond would poll in a busy loop, one
    /// longer than the longest wait would never come round: both refused,
    /// each interval named.
    #[test]
    fn intervals_out_of_range_are_refused_by_name() {
        let config = |poll_interval, gap_recheck| SubscriptionConfig {
            poll_interval,
            gap_recheck,
            ..SubscriptionConfig::default()
        };
        let ms = Duration::from_millis(1);
        assert!(config(ms, ms).validate().is_ok());
        let too_long = crate::queue::MAX_WAIT + Duration::from_secs(1);
        for (bad, named) in [
            (config(Duration::from_nanos(1), ms), "poll_interval"),
            (config(Duration::ZERO, ms), "poll_interval"),
            (config(Duration::MAX, ms), "poll_interval"),
            (config(ms, Duration::from_micros(999)), "gap_recheck"),
            (config(ms, too_long), "gap_recheck"),
        ] {
            match bad.validate() {
                Err(Error::Invalid { what, .. }) => assert!(what.ends_with(named), "{what}"),
                other => panic!("{named}: {other:?}"),
            }
        }
    }
}
