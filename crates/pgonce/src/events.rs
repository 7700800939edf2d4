//! A DCB event store (seed 001; <https://dcb.events/specification>): one
//! global log of events with types and tags, read by queries, appended to
//! under a condition.
//!
//! * An [`Event`] has a type, tags, JSON data and metadata; a
//!   [`StoredEvent`] adds its position.
//! * A [`Query`] is the OR of [`QueryItem`]s (an item: the type is any of its
//!   types, and the event carries all of its tags), or [`Query::all`].
//! * [`EventStore::append`] stores events atomically, failing with
//!   [`crate::Error::AppendConditionFailed`]
//!   (nothing written) when an event matching the condition's query exists
//!   after its `after` position (anywhere, without one).
//! * [`EventStore::decide`] returns the matching events and the `after` to
//!   append with, from one snapshot; [`EventStore::read`] and
//!   [`EventStore::head`] are plain reads; [`Subscription`] catches up.
//!
//! # Strategies ([`AppendStrategy`], one per store)
//!
//! | strategy | the check runs | concurrent conflicting appends | a type-only or match-all condition |
//! |---|---|---|---|
//! | `Serializable` | in a SERIALIZABLE transaction; PostgreSQL's predicate locks (GIN on tags, B-tree on type) find the read/write conflict | all run; one fails at commit (or earlier) with 40001 and is retried up to `max_retries` times, re-checking the condition | works unchanged; the predicate lock covers the index range or, for match-all, the table, so it conflicts with every concurrent append |
//! | `TableLock` | after `LOCK TABLE pgonce.events IN EXCLUSIVE MODE` | one writer at a time, whatever the tags | works unchanged; every writer already waits for every other |
//! | `AdvisoryLocks` | after exclusive advisory keys covering the condition (one per tag of each tagged item) | only appends sharing a key wait, in ascending key order | a type-only item locks its types' keys, a match-all query the "all" key: it waits for, and blocks, every append of those types (or every append) |
//!
//! Every strategy also takes, shared, a key per tag and type of the events
//! it appends and the "all" key ([`AppendKeys::publishing`]) before it draws
//! positions, and holds them until commit. Shared keys never wait for each
//! other; they make a condition's exclusive keys, and [`EventStore::decide`],
//! wait for the matching appends in flight.
//!
//! # Round trips
//!
//! A conditional append is three round trips after the pool hands out its
//! connection: one simple-query message that takes the strategy's locks and
//! then BEGINs (a lock that fails leaves the session idle, not in an aborted
//! transaction); one statement that checks the condition and, only if it
//! holds, inserts (through `pgonce.events_insert`, so the INSERT's plan is
//! cached while the check is planned for its `after`); COMMIT. A decision
//! read is the same locks message, the read, COMMIT. Under READ COMMITTED the
//! check's and the read's snapshots are taken after every lock was granted.
//!
//! # I5 whatever the commit order
//!
//! Positions are drawn at insert and become visible at commit, so an append
//! at position 9 may commit after 10 was read. Two things keep that harmless:
//!
//! * **Conditions.** [`EventStore::decide`] takes the query's keys exclusive
//!   before it reads, so it waits for every in-flight append of a matching
//!   event, and returns the head as `after`: every matching event at or
//!   below `after` is in the decision, and any later one is above `after`,
//!   where the condition looks. (A decision made from a plain
//!   [`EventStore::read`] has no such guarantee.)
//! * **Catch-up readers.** [`Subscription`] advances a horizon over positions
//!   that can no longer appear, using the transaction ids in
//!   `pg_current_snapshot()`: see [`subscription`](Subscription) for the
//!   argument. We chose a horizon over a commit-ordered position assigned
//!   under one global lock, because that lock would serialize every commit
//!   and undo the parallelism of the advisory strategy.

mod append;
mod model;
mod query;
mod read;
mod subscription;

use sqlx::PgPool;

pub use append::{ALL_NAMESPACE, AppendKeys, PendingAppend, TAG_NAMESPACE, TYPE_NAMESPACE};
pub use model::{
    AppendCondition, Appended, Decision, Event, Query, QueryItem, ReadOptions, StoredEvent,
};
pub use subscription::{PollCounters, Subscription, SubscriptionConfig};
#[doc(hidden)]
pub use subscription::{PollHook, PollPoint};

use crate::error::{Error, Result};

/// The channel appends NOTIFY (payload: the last position) on commit.
pub const NOTIFY_CHANNEL: &str = "pgonce_events";

/// How an append enforces its condition against concurrent appends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AppendStrategy {
    /// SERIALIZABLE check-then-insert, retried on serialization failure.
    Serializable,
    /// `LOCK TABLE ... IN EXCLUSIVE MODE`, then check and insert.
    TableLock,
    /// Sorted per-tag (per-type, "all") advisory keys, then check and insert.
    AdvisoryLocks,
}

impl AppendStrategy {
    pub const ALL: [AppendStrategy; 3] = [
        AppendStrategy::Serializable,
        AppendStrategy::TableLock,
        AppendStrategy::AdvisoryLocks,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AppendStrategy::Serializable => "serializable",
            AppendStrategy::TableLock => "table-lock",
            AppendStrategy::AdvisoryLocks => "advisory-locks",
        }
    }
}

/// Settings of an [`EventStore`].
#[derive(Debug, Clone)]
pub struct EventStoreConfig {
    /// Default [`AppendStrategy::AdvisoryLocks`].
    pub strategy: AppendStrategy,
    /// Serialization failures retried per append (SSI). Default 20; at most
    /// 1000.
    pub max_retries: u32,
    /// NOTIFY [`NOTIFY_CHANNEL`] on each append, waking subscriptions.
    /// Default true. (PostgreSQL serializes the commits of notifying
    /// transactions on one lock; subscriptions poll without it.)
    pub notify: bool,
}

impl Default for EventStoreConfig {
    fn default() -> Self {
        EventStoreConfig {
            strategy: AppendStrategy::AdvisoryLocks,
            max_retries: 20,
            notify: true,
        }
    }
}

/// The event store on a pool whose database ran [`crate::migrate`].
#[derive(Debug, Clone)]
pub struct EventStore {
    pool: PgPool,
    config: EventStoreConfig,
}

impl EventStore {
    pub fn new(pool: PgPool, config: EventStoreConfig) -> Result<EventStore> {
        if config.max_retries > 1000 {
            return Err(Error::Invalid {
                what: "event store config",
                why: "max_retries must be at most 1000".into(),
            });
        }
        Ok(EventStore { pool, config })
    }

    pub fn config(&self) -> &EventStoreConfig {
        &self.config
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Appends `events` atomically if `condition` holds (see the module docs
    /// for what each strategy does). Retries serialization failures.
    pub async fn append(
        &self,
        events: &[Event],
        condition: Option<&AppendCondition>,
    ) -> Result<Appended> {
        append::append(
            &self.pool,
            self.config.strategy,
            self.config.notify,
            self.config.max_retries,
            events,
            condition,
        )
        .await
    }

    /// One attempt of an append, stopped before COMMIT: for step-by-step
    /// races and for callers that must commit other writes with it. No
    /// retry.
    pub async fn begin_append(
        &self,
        events: &[Event],
        condition: Option<&AppendCondition>,
    ) -> Result<PendingAppend> {
        append::begin(
            &self.pool,
            self.config.strategy,
            self.config.notify,
            events,
            condition,
        )
        .await
    }

    /// Appends `events`, with no condition, inside the caller's open
    /// transaction: they commit or roll back with the caller's other writes
    /// (an incident and its timeline event, say). Returns their positions,
    /// visible once `tx` commits.
    ///
    /// Takes the same shared publishing keys as [`EventStore::append`], so
    /// conditions and decisions over these events wait for `tx`. Under
    /// [`AppendStrategy::Serializable`] `tx` must be SERIALIZABLE
    /// ([`Error::WrongIsolation`] otherwise: PostgreSQL's conflict detection
    /// ignores writes of other isolation levels); under the other strategies
    /// any isolation will do. Takes the store's pool for nothing: `tx` may
    /// come from any pool on the same database.
    pub async fn append_in(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        events: &[Event],
    ) -> Result<Vec<i64>> {
        append::append_in(tx, self.config.strategy, self.config.notify, events).await
    }

    /// Matching events by position (a plain snapshot read).
    pub async fn read(&self, query: &Query, options: ReadOptions) -> Result<Vec<StoredEvent>> {
        read::read(&self.pool, query, options).await
    }

    /// The highest committed position, `None` for an empty log.
    pub async fn head(&self) -> Result<Option<i64>> {
        read::head(&self.pool).await
    }

    /// The decision read: the events matching `query` and the `after` to
    /// append with, from one snapshot taken once no matching append is in
    /// flight (module docs, I5).
    pub async fn decide(&self, query: &Query) -> Result<Decision> {
        read::decide(&self.pool, query).await
    }

    /// A catch-up subscription on this store's database.
    pub async fn subscribe(&self, config: SubscriptionConfig) -> Result<Subscription> {
        Subscription::new(self.pool.clone(), config).await
    }
}
