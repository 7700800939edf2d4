//! A DCB event store (<https://dcb.events/specification>; three writers on
//! overlapping tags are replayed against it by `pgonce race events`): one
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
//! | `Serializable` | in a SERIALIZABLE transaction; PostgreSQL's predicate locks (GIN on tags, B-tree on type) find the read/write conflict; every append, with a condition or not, also reads the conditional appends above its own positions (below) | all run; one fails at commit (or earlier) with 40001 and is retried up to `max_retries` times, re-checking the condition | works unchanged; the predicate lock covers the index range or, for match-all, the table, so it conflicts with every concurrent append |
//! | `TableLock` | after `LOCK TABLE pgonce.events IN EXCLUSIVE MODE` | one writer at a time, whatever the tags | works unchanged; every writer already waits for every other |
//! | `AdvisoryLocks` | after exclusive advisory keys covering the condition (one per tag of each tagged item) | only appends sharing a key wait, in ascending key order | a type-only item locks its types' keys, a match-all query the "all" key: it waits for, and blocks, every append of those types (or every append) |
//!
//! Every strategy also takes, shared, a key per tag and type of the events
//! it appends and the "all" key ([`AppendKeys::publishing`]) before it draws
//! positions, and holds them until commit. Shared keys never wait for each
//! other; they make a condition's exclusive keys, and [`EventStore::decide`],
//! wait for the matching appends in flight.
//!
//! # Why every append reads the conditional appends above it (Serializable)
//!
//! The rule every strategy keeps: once the transactions involved have ended,
//! no committed conditional append `C` (condition `Q`, `after` = `a`, lowest
//! position `c`) has a committed event matching `Q` at a position in
//! `(a, c)`. The locking strategies keep it by waiting: every append holds,
//! from before it draws a position until it ends, the shared key of each of
//! its tags and types and a ROW EXCLUSIVE lock on the table (its INSERT); a
//! condition's exclusive keys, or the table lock, wait for all of them, and
//! the check's snapshot is taken after.
//!
//! The serializable strategy waits for nobody, so it has to make such a pair
//! non-serializable, and leave PostgreSQL to abort one of the two
//! (PostgreSQL's serializable level guarantees that concurrent serializable
//! transactions that all commit have the effect of some serial order of
//! them). Take `W`, the append of a matching event at `w` in `(a, c)`, both
//! SERIALIZABLE, both committed:
//!
//! * `C`'s check read `Q` above `a` and did not see `W`'s event (else the
//!   condition fails). So in a serial order `C` comes before `W`. (The check
//!   is a predicate read on the GIN or type index, or the table for a
//!   match-all query; PostgreSQL tracks it whether `W` inserted before the
//!   read or after.)
//! * `W` read the rows marked `conditional` above its lowest position
//!   (`pgonce.events_insert`, migration 0090), and `C`'s row, at `c > w`, is
//!   one of them. `W`'s snapshot was taken at its first statement, before it
//!   drew `w`; `c` was drawn after `w`, so `C` had not committed when that
//!   snapshot was taken, and `W` did not see `C`'s row. So `W` comes before
//!   `C`.
//!
//! No serial order has both, so PostgreSQL cannot commit both: one of them
//! fails with 40001 (at the latest at its commit), and a retried
//! [`EventStore::append`] checks again. Without `W`'s read only the first
//! dependency existed, a serial order (`C`, then `W`) did exist, and both
//! committed with `W`'s event below `C`'s: a SERIALIZABLE append that checks
//! no condition reads nothing, and no check can be written into its
//! statement after the fact. `W`'s read scans a partial index holding only
//! conditional rows, from `w` to its right edge (nothing there is visible to
//! `W` but its own rows, so the scan never stops early); its predicate lock
//! therefore covers every conditional append drawn after `w`, and is kept
//! after `W` commits for as long as a transaction that overlapped it runs.
//!
//! The cost: `W` now conflicts with every concurrent conditional append
//! drawn after it, whatever its tags. That is one dependency, not a cycle,
//! and aborts nothing by itself; it can complete a cycle through a third
//! transaction, so the serializable strategy retries somewhat more.
//!
//! Writers the argument does not cover are refused:
//! [`EventStore::append_in`] under the serializable strategy needs a
//! SERIALIZABLE transaction ([`Error::WrongIsolation`] otherwise), since
//! PostgreSQL detects no conflict with a write made at another isolation
//! level.
//!
//! # Mixing strategies
//!
//! The strategy is a property of the [`EventStore`] value, not of the
//! database, and nothing stops two stores on one database from using
//! different ones. What holds then:
//!
//! * A condition checked under `TableLock` or `AdvisoryLocks` holds against
//!   writers of every strategy: they all take the shared publishing keys and
//!   insert under ROW EXCLUSIVE, which is what those conditions wait for.
//! * A condition checked under `Serializable` holds only against writers
//!   that also use `Serializable` (SERIALIZABLE, with the read above): an
//!   append made by a `TableLock` or `AdvisoryLocks` store runs at READ
//!   COMMITTED, invisible to PostgreSQL's conflict detection, and can commit
//!   a matching event below the conditional one.
//!
//! So a database whose conditions are checked under `Serializable` must
//! have all its writers use `Serializable`; switching strategies means
//! switching every writer, or moving to a locking strategy first (safe
//! against writers of both kinds while they are mixed).
//!
//! Rows written into `pgonce.events` other than through an [`EventStore`]
//! (a plain `INSERT`) are outside every argument above: such a writer
//! holds no publishing key, so a condition checked under `AdvisoryLocks`
//! while it is in flight neither waits for it nor sees it, and commits
//! above its row; under `Serializable` it reads no conditional append, so
//! SERIALIZABLE finds no cycle. (`TableLock` alone still waits for it, on
//! its INSERT's ROW EXCLUSIVE lock.) A writer that has to use SQL does
//! what an append does, in its order: the shared keys of its events' tags
//! and types and the "all" key, ascending ([`crate::lock::DERIVE_KEY_SQL`]
//! computes them), its transaction id, then the insert through
//! `pgonce.events_insert(events, channel, false, read_later)`, with
//! `read_later` true, in a SERIALIZABLE transaction, where conditions are
//! checked under `Serializable`.
//!
//! # Round trips
//!
//! Under the lock strategies, a conditional append and a decision read are
//! one statement each after the pool hands out its connection: a PL/pgSQL
//! function run as its own transaction, which takes the keys (and the
//! table lock), then checks and inserts, or reads. In a READ COMMITTED
//! transaction each statement such a function runs takes a new snapshot,
//! so the check and the read see every append the keys waited for. The
//! commonest query, one item naming tags and no types, runs through
//! statements whose plans the session keeps (`pgonce.events_append_tag_item`,
//! `pgonce.events_decide_tag_item`, migration 0170; an append of one event
//! passes its fields as parameters, `pgonce.events_append_one_tag_item`,
//! migration 0180); any other query is built as text and planned for its
//! values at each call (`pgonce.events_append`, `pgonce.events_decide`,
//! migration 0110).
//!
//! The serializable strategy, and a session whose default isolation is not
//! READ COMMITTED (the functions refuse it), take the transaction path,
//! three round trips: one simple-query message that sets the isolation,
//! takes the strategy's locks and then BEGINs (a lock that fails leaves the
//! session idle, not in an aborted transaction); one statement that checks
//! the condition and, only if it holds, inserts (through
//! `pgonce.events_insert`, so the INSERT's plan is cached while the check
//! is planned for its `after`); COMMIT. A decision read there is the same
//! locks message, the read, COMMIT.
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
//!
//! # Cancel safety
//!
//! [`EventStore::append`] and [`EventStore::decide`] run one statement on
//! the pool (its own transaction), or, where that statement cannot serve
//! (another strategy, another default isolation), a transaction begun
//! with BEGIN and the locks in one round trip, handed to a task of its own
//! if the caller stops waiting, which rolls it back once begun; [`EventStore::begin_append`]
//! always the latter. A call dropped at any await, its lock wait included,
//! leaves no transaction open and no lock held, and its connection goes
//! back to the pool clean once the wait has ended. A dropped append's
//! events are committed or absent, all of them, and the caller does not
//! know which: a retry under the same condition then fails on them if they
//! were. [`EventStore::append_in`] runs in the caller's transaction:
//! dropped, its events may or may not be inserted there; roll the
//! transaction back.

mod append;
mod model;
mod query;
mod read;
mod subscription;

use sqlx::PgPool;

pub use crate::json::MAX_JSON_NESTING;
pub use append::{
    ALL_NAMESPACE, AppendKeys, MAX_LOCK_KEYS, PendingAppend, TAG_NAMESPACE, TYPE_NAMESPACE,
};
pub use model::{
    AppendCondition, Appended, Decision, Event, MAX_NAME_BYTES, MAX_QUERY_ITEMS, Query, QueryItem,
    ReadOptions, StoredEvent,
};
pub use subscription::{PollCounters, PollOutcome, Subscription, SubscriptionConfig};
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
    /// Every strategy, in a fixed order, for runs that compare them side by side.
    pub const ALL: [AppendStrategy; 3] = [
        AppendStrategy::Serializable,
        AppendStrategy::TableLock,
        AppendStrategy::AdvisoryLocks,
    ];

    /// The strategy's stable kebab-case name, as printed by benches and used
    /// in metric labels.
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
    /// Serialization failures (and deadlocks) retried per append, each
    /// after a random pause that doubles up to 64 ms, so that appends that
    /// failed together do not retry together. Default 20; at most 1000.
    /// Past it the append is [`Error::SerializationFailure`], nothing
    /// appended.
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

/// The event store on a pool whose database ran [`crate::migrate()`].
#[derive(Debug, Clone)]
pub struct EventStore {
    pool: PgPool,
    config: EventStoreConfig,
}

impl EventStore {
    /// An event store on `pool`. [`Error::Invalid`] if
    /// [`EventStoreConfig::max_retries`] exceeds 1000; touches no connection.
    pub fn new(pool: PgPool, config: EventStoreConfig) -> Result<EventStore> {
        if config.max_retries > 1000 {
            return Err(Error::Invalid {
                what: "event store config",
                why: "max_retries must be at most 1000".into(),
            });
        }
        Ok(EventStore { pool, config })
    }

    /// The settings this store was built with.
    pub fn config(&self) -> &EventStoreConfig {
        &self.config
    }

    /// The pool appends and reads run on.
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
    /// ([`Error::WrongIsolation`] otherwise, nothing written: PostgreSQL's
    /// conflict detection ignores writes of other isolation levels), and the
    /// insert reads the conditional appends above it (module docs), so `tx`
    /// may fail with a serialization failure at its commit: retry the whole
    /// transaction. Under the other strategies any isolation will do. Takes the store's pool for nothing: `tx` may
    /// come from any pool on the same database.
    pub async fn append_in(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        events: &[Event],
    ) -> Result<Vec<i64>> {
        append::append_in(tx, self.config.strategy, self.config.notify, events).await
    }

    /// Matching events by position (a plain snapshot read).
    /// [`Error::Invalid`] for a bad query or a negative
    /// [`ReadOptions::limit`], nothing read.
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
