//! Incidents: created by the pipeline (guarded, or plain during a rollout)
//! or declared by hand, numbered per organization, moved through their
//! lifecycle, each change recorded on the incident's timeline.
//!
//! # What one creation commits, in one READ COMMITTED transaction
//!
//! 1. (guarded path) the entity's advisory lock, then the re-read of what
//!    the decision saw, compared with it ([`pgonce::GuardedTransaction`]);
//! 2. the incident's id (drawn from its identity sequence, so the next two
//!    steps can name it before the number exists);
//! 3. the notification job ([`pgonce::job::enqueue`]), its idempotency key
//!    drawn here ([`NotificationPayload`]), and the `IncidentOpened`
//!    timeline event ([`pgonce::EventStore::append_in`]);
//! 4. last, the organization's next number and the incident row
//!    ([`pgonce::Sequence::commit_numbered`]), then COMMIT.
//!
//! Everything commits or nothing does: no incident without its notification
//! or its timeline, no number used by a rolled-back incident (I2). The
//! organization's number lock is held only for step 4 (three round trips),
//! whatever the rest took, so the pipeline and people declaring by hand in
//! one organization wait for each other as little as gapless numbers allow.
//! Locks are always taken entity first, organization second, so two
//! creations cannot deadlock.

use std::time::Duration;

use pgonce::IsolationLevel;
use pgonce::events::{AppendStrategy, Event, Query, QueryItem, ReadOptions, StoredEvent};
use pgonce::job::{self, NewJob};
use pgonce::{
    EventStore, EventStoreConfig, Guard, GuardConfig, LockKey, NumberedTable, ReadSet, Sequence,
    SequenceConfig,
};
use serde_json::json;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use time::OffsetDateTime;

use crate::error::{Error, Result};
use crate::model::{Declaration, Incident, IncidentFilter, Lifecycle, Policy};
use crate::notifier::NotificationPayload;
use crate::store;

/// The lock namespace of per-entity incident writes (key: the entity id in
/// decimal). Any client may take it with [`pgonce::lock`] to change what
/// the guarded write reads.
pub const ENTITY_LOCK_NAMESPACE: &str = "pgonce-incidents/entity";
/// The lock namespace of idempotent declarations (key: `<org>/<key>`).
pub const DECLARATION_LOCK_NAMESPACE: &str = "pgonce-incidents/declaration";
/// Longest a feed page keeps settling a gap or scanning past other
/// organizations' positions when the caller asked for a shorter wait.
pub const FEED_GAP_WAIT: Duration = Duration::from_secs(1);
/// How often a feed page looks at a gap again.
const FEED_GAP_RECHECK: Duration = Duration::from_millis(5);
/// The job kind of incident notifications (payload [`NotificationPayload`]).
pub const NOTIFY_JOB_KIND: &str = "incident-notification";

/// The entity's lock key, shared by the guarded write and every other writer
/// of what it reads.
pub fn entity_lock_key(entity_id: i64) -> pgonce::Result<LockKey> {
    LockKey::new(ENTITY_LOCK_NAMESPACE, &entity_id.to_string())
}

/// The lock key of a declaration's idempotency key `key` in the
/// organization, held by a declaration with that key from its lookup to
/// its commit.
pub fn declaration_lock_key(organization_id: i64, key: &str) -> pgonce::Result<LockKey> {
    LockKey::new(
        DECLARATION_LOCK_NAMESPACE,
        &format!("{organization_id}/{key}"),
    )
}

/// Settings of a [`Service`].
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// How organization numbers are serialized. Default: an advisory lock
    /// per organization ([`pgonce::SequenceStrategy::AdvisoryLock`]).
    pub numbering: pgonce::SequenceStrategy,
    /// Longest wait for an entity's lock (of a guarded incident write, and
    /// of the API's `PUT /v1/entities/{id}/singleton`) before
    /// [`pgonce::Error::LockTimeout`], which the API answers 503 `busy`.
    /// Default 10 s.
    pub entity_lock_timeout: Duration,
    /// Longest wait of a declaration for its idempotency key's lock (held
    /// by a declaration with the same key until it commits) before
    /// [`pgonce::Error::LockTimeout`], which the API answers 503 `busy`.
    /// Without a bound, a request would wait as long as the holder takes,
    /// its pooled connection with it. Default 10 s; 1 ms to
    /// [`pgonce::lock::MAX_LOCK_TIMEOUT`].
    pub declaration_lock_timeout: Duration,
    /// Attempts of a notification job before it is dead. Default 8.
    pub notify_max_attempts: i32,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            numbering: pgonce::SequenceStrategy::AdvisoryLock,
            entity_lock_timeout: Duration::from_secs(10),
            declaration_lock_timeout: Duration::from_secs(10),
            notify_max_attempts: 8,
        }
    }
}

/// The incident service's writes and reads. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Service {
    pool: PgPool,
    guard: Guard,
    numbers: Sequence,
    timeline: EventStore,
    config: ServiceConfig,
}

/// What a pipeline decision saw for one (policy, entity, message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// The policy evaluated.
    pub policy_id: i64,
    /// The entity it was evaluated on.
    pub entity_id: i64,
    /// The observation's key ([`crate::model::Observation::ledger_key`]), under which
    /// the incidents it creates are recorded.
    pub message_id: String,
    /// Whether the policy allowed at most one OPEN incident for this entity.
    pub singleton: bool,
    /// The OPEN incidents of this (policy, entity), ascending.
    pub open: Vec<i64>,
    /// The incidents this message already created for this policy.
    pub from_message: Vec<i64>,
}

/// What a pipeline decision concluded, before any write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Open an incident.
    Open,
    /// An earlier delivery of this message already opened it.
    AlreadyOpenedByMessage,
    /// The policy is a singleton here and an incident is already open.
    AlreadyOpen,
}

impl Observed {
    /// The decision for a violated policy.
    pub fn decide(&self) -> Decision {
        if !self.from_message.is_empty() {
            Decision::AlreadyOpenedByMessage
        } else if self.singleton && !self.open.is_empty() {
            Decision::AlreadyOpen
        } else {
            Decision::Open
        }
    }

    /// The read set the guard compares: the rule, this message's incidents
    /// and, when the rule is "one at a time", the open ones (otherwise any
    /// number may be open and they do not matter to the decision).
    pub fn read_set(&self) -> ReadSet {
        let mine = self
            .from_message
            .iter()
            .map(|id| format!("from-message:{id}"));
        if self.singleton {
            ReadSet::from_ids(self.open.iter().map(|id| format!("open:{id}")).chain(mine))
                .with("rule:singleton", None)
        } else {
            ReadSet::from_ids(mine).with("rule:many", None)
        }
    }
}

/// How a pipeline incident is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritePath {
    /// Lock the entity, re-read, compare, then write (keeps I1).
    Guarded,
    /// The naive two transactions: read in one, then write in another
    /// whatever the state is now. Kept for the rollout, and to show what it
    /// breaks.
    Plain,
}

/// The row to insert once the number is known.
struct NewIncident<'a> {
    organization_id: i64,
    policy_id: Option<i64>,
    entity_id: Option<i64>,
    source_message_id: Option<&'a str>,
    idempotency_key: Option<&'a str>,
    title: &'a str,
    actor: &'a str,
    /// Whether the policy allowed one OPEN incident for the entity when the
    /// decision was made (recorded for the I1 check; false when declared).
    one_at_a_time: bool,
}

/// An incident as `service/sql/*.sql` return it (the columns of
/// `incidents.incidents` an [`Incident`] shows).
#[derive(sqlx::FromRow)]
struct IncidentRow {
    id: i64,
    organization_id: i64,
    number: i64,
    policy_id: Option<i64>,
    entity_id: Option<i64>,
    lifecycle: String,
    title: String,
    opened_by: String,
    opened_at: OffsetDateTime,
    acknowledged_by: Option<String>,
    acknowledged_at: Option<OffsetDateTime>,
    resolved_by: Option<String>,
    resolved_at: Option<OffsetDateTime>,
}

fn incident(r: IncidentRow) -> Result<Incident> {
    Ok(Incident {
        id: r.id,
        organization_id: r.organization_id,
        number: r.number,
        policy_id: r.policy_id,
        entity_id: r.entity_id,
        lifecycle: r.lifecycle.parse()?,
        title: r.title,
        opened_by: r.opened_by,
        opened_at: r.opened_at,
        acknowledged_by: r.acknowledged_by,
        acknowledged_at: r.acknowledged_at,
        resolved_by: r.resolved_by,
        resolved_at: r.resolved_at,
    })
}

/// What `service/sql/observe.sql` reads about a (policy, entity) pair.
#[derive(sqlx::FromRow)]
struct ObservedRow {
    singleton: bool,
    open_ids: Vec<i64>,
    from_message_ids: Vec<i64>,
}

async fn read_observed(
    conn: &mut PgConnection,
    policy_id: i64,
    entity_id: i64,
    message_id: &str,
) -> pgonce::Result<Observed> {
    let row: Option<ObservedRow> = sqlx::query_as(include_str!("service/sql/observe.sql"))
        .bind(policy_id)
        .bind(entity_id)
        .bind(message_id)
        .fetch_optional(conn)
        .await?;
    let row = row.ok_or_else(|| pgonce::Error::Invalid {
        what: "policy and entity",
        why: format!("no policy {policy_id} with entity {entity_id} in its organization"),
    })?;
    Ok(Observed {
        policy_id,
        entity_id,
        message_id: message_id.to_owned(),
        singleton: row.singleton,
        open: row.open_ids,
        from_message: row.from_message_ids,
    })
}

/// The tags of an incident's events: its organization (the feed), itself
/// (the timeline) and its entity.
fn incident_tags(
    event: Event,
    organization_id: i64,
    incident_id: i64,
    entity_id: Option<i64>,
) -> Event {
    let event = event
        .tag(format!("org:{organization_id}"))
        .tag(format!("incident:{incident_id}"));
    match entity_id {
        Some(e) => event.tag(format!("entity:{e}")),
        None => event,
    }
}

impl Service {
    /// A service on `pool` (migrated with [`crate::migrate`]).
    pub fn new(pool: PgPool, config: ServiceConfig) -> Result<Service> {
        let guard = Guard::new(
            "create-incident",
            GuardConfig {
                lock_timeout: Some(config.entity_lock_timeout),
                ..GuardConfig::default()
            },
        )?;
        let numbers = Sequence::new(
            NumberedTable::new("incidents.incidents", "organization_id", "number")?,
            SequenceConfig {
                strategy: config.numbering,
            },
        )?;
        // No NOTIFY: the feed polls, and notifying transactions serialize
        // their commits on one lock while the organization's is held.
        let timeline = EventStore::new(
            pool.clone(),
            EventStoreConfig {
                strategy: AppendStrategy::AdvisoryLocks,
                notify: false,
                ..EventStoreConfig::default()
            },
        )?;
        if config.notify_max_attempts < 1 {
            return Err(Error::invalid("notify_max_attempts", "at least 1"));
        }
        // Checked here, not at the first declaration with a key: PostgreSQL's
        // lock_timeout holds at most MAX_LOCK_TIMEOUT, and 0 would mean none.
        let declaration_wait = config.declaration_lock_timeout;
        if declaration_wait < Duration::from_millis(1)
            || declaration_wait > pgonce::lock::MAX_LOCK_TIMEOUT
        {
            return Err(Error::invalid(
                "declaration_lock_timeout",
                "must be 1 ms to about 24.8 days (PostgreSQL's lock_timeout)",
            ));
        }
        Ok(Service {
            pool,
            guard,
            numbers,
            timeline,
            config,
        })
    }

    /// The pool the service runs its transactions on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The advisory key under which an organization's numbers are taken
    /// (for tests and races that hold it on purpose).
    pub fn number_lock_key(&self, organization_id: i64) -> Result<LockKey> {
        Ok(self.numbers.lock_key(&organization_id)?)
    }

    /// The settings this service was built with.
    pub fn config(&self) -> &ServiceConfig {
        &self.config
    }

    /// The decision's read for `policy` on `entity_id` while handling
    /// `message_id`: one statement on a connection returned to the pool
    /// before this returns, so the evaluation that follows holds none.
    pub async fn observe(
        &self,
        policy: &Policy,
        entity_id: i64,
        message_id: &str,
    ) -> Result<Observed> {
        let mut out = None;
        self.guard
            .read(&self.pool, async |conn| {
                let seen = read_observed(conn, policy.id, entity_id, message_id).await?;
                let set = seen.read_set();
                out = Some(seen);
                Ok(set)
            })
            .await?;
        Ok(out.expect("the read ran"))
    }

    /// Opens the incident a pipeline decision asked for. On the guarded
    /// path, only if what `seen` recorded still holds; otherwise
    /// [`pgonce::Error::Conflict`] (as [`Error::Pgonce`]) and nothing is
    /// written: the caller acks, and the entity's next observation
    /// re-evaluates. On the plain path, unconditionally.
    pub async fn open_from_pipeline(
        &self,
        organization_id: i64,
        seen: &Observed,
        title: &str,
        path: WritePath,
    ) -> Result<Incident> {
        let new = NewIncident {
            organization_id,
            policy_id: Some(seen.policy_id),
            entity_id: Some(seen.entity_id),
            source_message_id: Some(&seen.message_id),
            idempotency_key: None,
            title,
            actor: "pipeline",
            one_at_a_time: seen.singleton,
        };
        let tx = match path {
            WritePath::Guarded => {
                let (policy_id, entity_id, message) =
                    (seen.policy_id, seen.entity_id, seen.message_id.as_str());
                let key = entity_lock_key(entity_id)?;
                // BEGIN and the entity lock in one round trip.
                let mut tx = self.guard.begin_for(&self.pool, key).await?;
                let checked = tx
                    .check(key, &seen.read_set(), async |conn| {
                        Ok(read_observed(conn, policy_id, entity_id, message)
                            .await?
                            .read_set())
                    })
                    .await;
                if let Err(e) = checked {
                    // Release the entity lock now, not when the pooled
                    // connection is next used (sqlx sends a dropped
                    // transaction's ROLLBACK lazily).
                    let _ = tx.rollback().await;
                    return Err(e.into());
                }
                tx.into_inner()
            }
            WritePath::Plain => self.begin().await?,
        };
        self.insert_numbered(tx, new).await
    }

    /// A declaration by hand: the organization's next number, like any other
    /// incident, concurrent declarations in the organization included. With
    /// an idempotency key, declaring twice returns the first incident (the
    /// key is locked, then looked up, in the declaring transaction); the same
    /// key with another title, entity or actor is [`Error::Invalid`]. The
    /// key's lock is waited for at most
    /// [`ServiceConfig::declaration_lock_timeout`], then
    /// [`pgonce::Error::LockTimeout`] with nothing written.
    pub async fn declare(
        &self,
        organization_id: i64,
        declaration: &Declaration,
        actor: &str,
    ) -> Result<Incident> {
        declaration.validate()?;
        crate::model::check_name("actor", actor)?;
        store::get_organization(&self.pool, organization_id).await?;
        let entity_id = match &declaration.entity {
            Some(external) => Some(
                store::find_entity(&self.pool, organization_id, external)
                    .await?
                    .id,
            ),
            None => None,
        };
        let mut tx = self.begin().await?;
        if let Some(key) = &declaration.idempotency_key {
            match self.declared_before(&mut tx, organization_id, key).await {
                Ok(None) => {}
                Ok(Some(row)) => {
                    tx.rollback().await?;
                    let first = incident(row)?;
                    // A key names one request: reused for another (the
                    // convention of Stripe and of the Idempotency-Key
                    // header's draft), it is refused, not answered with an
                    // incident the caller did not ask for.
                    if first.title != declaration.title
                        || first.entity_id != entity_id
                        || first.opened_by != actor
                    {
                        return Err(Error::invalid(
                            "idempotency key",
                            "was already used for a different declaration (title, entity or actor)",
                        ));
                    }
                    return Ok(first);
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(e);
                }
            }
        }
        let new = NewIncident {
            organization_id,
            policy_id: None,
            entity_id,
            source_message_id: None,
            idempotency_key: declaration.idempotency_key.as_deref(),
            title: &declaration.title,
            actor,
            one_at_a_time: false,
        };
        self.insert_numbered(tx, new).await
    }

    /// Locks the declaration key and looks it up. READ COMMITTED: the
    /// lookup's snapshot is taken after the lock, so it sees a declaration
    /// with this key committed by the lock's previous holder. The wait is
    /// bounded: the holder may take as long as its organization's number
    /// lock makes it wait, and a request waiting on it holds a pooled
    /// connection all along. On timeout the caller rolls `tx` back, which
    /// holds nothing yet.
    async fn declared_before(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        organization_id: i64,
        key: &str,
    ) -> Result<Option<IncidentRow>> {
        let lock = declaration_lock_key(organization_id, key)?;
        pgonce::lock::lock_timeout(tx, lock, self.config.declaration_lock_timeout).await?;
        Ok(sqlx::query_as(include_str!("service/sql/find_by_key.sql"))
            .bind(organization_id)
            .bind(key)
            .fetch_optional(&mut **tx)
            .await?)
    }

    async fn begin(&self) -> Result<Transaction<'static, Postgres>> {
        Ok(pgonce::begin(&self.pool, IsolationLevel::ReadCommitted).await?)
    }

    /// Steps 2 and 3 of the module docs: the id, the notification job, the
    /// timeline event. Returns the id.
    async fn prepare(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        new: &NewIncident<'_>,
    ) -> Result<i64> {
        let id: i64 = sqlx::query_scalar(include_str!("service/sql/next_id.sql"))
            .fetch_one(&mut **tx)
            .await?;
        job::enqueue(
            &mut **tx,
            &NewJob::new(NOTIFY_JOB_KIND, NotificationPayload::new(id).to_job())
                .max_attempts(self.config.notify_max_attempts),
        )
        .await?;
        let opened = Event::new("IncidentOpened").data(json!({
            "title": new.title,
            "actor": new.actor,
            "policy_id": new.policy_id,
            "source_message_id": new.source_message_id,
        }));
        self.timeline
            .append_in(
                tx,
                &[incident_tags(
                    opened,
                    new.organization_id,
                    id,
                    new.entity_id,
                )],
            )
            .await?;
        Ok(id)
    }

    /// Steps 2-4 of the module docs, ending with COMMIT.
    async fn insert_numbered(
        &self,
        mut tx: Transaction<'_, Postgres>,
        new: NewIncident<'_>,
    ) -> Result<Incident> {
        let id = match self.prepare(&mut tx, &new).await {
            Ok(id) => id,
            Err(e) => {
                // Release the entity lock now (see open_from_pipeline).
                let _ = tx.rollback().await;
                return Err(e);
            }
        };
        let numbered = self
            .numbers
            .commit_numbered(
                tx,
                &new.organization_id,
                async |conn: &mut PgConnection, number: i64| {
                    let row: IncidentRow = sqlx::query_as(include_str!("service/sql/insert.sql"))
                        .bind(id)
                        .bind(new.organization_id)
                        .bind(number)
                        .bind(new.policy_id)
                        .bind(new.entity_id)
                        .bind(new.source_message_id)
                        .bind(new.idempotency_key)
                        .bind(new.title)
                        .bind(new.actor)
                        .bind(new.one_at_a_time)
                        .fetch_one(conn)
                        .await?;
                    Ok(row)
                },
            )
            .await?;
        metrics::counter!("pgonce_incidents_opened_total").increment(1);
        metrics::histogram!("pgonce_incidents_number_lock_held_seconds")
            .record(numbered.held.as_secs_f64());
        incident(numbered.value)
    }

    /// OPEN -> ACKNOWLEDGED. [`Error::InvalidTransition`] from any other
    /// state; [`Error::NotFound`] for an incident of another organization.
    pub async fn acknowledge(
        &self,
        organization_id: i64,
        id: i64,
        actor: &str,
    ) -> Result<Incident> {
        self.transition(
            organization_id,
            id,
            actor,
            &[Lifecycle::Open],
            Lifecycle::Acknowledged,
            "acknowledge",
        )
        .await
    }

    /// OPEN or ACKNOWLEDGED -> RESOLVED. Errors as for
    /// [`Service::acknowledge`]. Resolving only ever shrinks the set of open
    /// incidents a guarded write re-reads, so it needs no entity lock: a
    /// decision it makes stale can only be one that opens nothing.
    pub async fn resolve(&self, organization_id: i64, id: i64, actor: &str) -> Result<Incident> {
        self.transition(
            organization_id,
            id,
            actor,
            &[Lifecycle::Open, Lifecycle::Acknowledged],
            Lifecycle::Resolved,
            "resolve",
        )
        .await
    }

    /// One conditional UPDATE and its timeline event, in one transaction:
    /// of two concurrent callers one changes the state and the other gets
    /// [`Error::InvalidTransition`].
    async fn transition(
        &self,
        organization_id: i64,
        id: i64,
        actor: &str,
        from: &[Lifecycle],
        to: Lifecycle,
        action: &'static str,
    ) -> Result<Incident> {
        crate::model::check_name("actor", actor)?;
        let mut tx = self.begin().await?;
        let changed = match self
            .transition_in(&mut tx, organization_id, id, actor, from, to)
            .await
        {
            Ok(Some(changed)) => changed,
            Ok(None) => {
                tx.rollback().await?;
                let current = self.get(organization_id, id).await?;
                return Err(Error::InvalidTransition {
                    id,
                    from: current.lifecycle.to_string(),
                    action,
                });
            }
            Err(e) => {
                // The UPDATE's row lock goes now, not at the connection's
                // next use.
                let _ = tx.rollback().await;
                return Err(e);
            }
        };
        tx.commit().await?;
        metrics::counter!("pgonce_incidents_transitions_total", "to" => to.as_str()).increment(1);
        Ok(changed)
    }

    /// The UPDATE and the timeline event; `None` when the incident is not in
    /// a `from` state (or not the organization's).
    async fn transition_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        organization_id: i64,
        id: i64,
        actor: &str,
        from: &[Lifecycle],
        to: Lifecycle,
    ) -> Result<Option<Incident>> {
        let from_names: Vec<&str> = from.iter().map(|l| l.as_str()).collect();
        let row: Option<IncidentRow> = sqlx::query_as(include_str!("service/sql/transition.sql"))
            .bind(organization_id)
            .bind(id)
            .bind(&from_names)
            .bind(to.as_str())
            .bind(actor)
            .fetch_optional(&mut **tx)
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let changed = incident(row)?;
        let event_type = match to {
            Lifecycle::Acknowledged => "IncidentAcknowledged",
            Lifecycle::Resolved => "IncidentResolved",
            Lifecycle::Open => "IncidentOpened",
        };
        let event =
            Event::new(event_type).data(json!({ "actor": actor, "number": changed.number }));
        self.timeline
            .append_in(
                tx,
                &[incident_tags(event, organization_id, id, changed.entity_id)],
            )
            .await?;
        Ok(Some(changed))
    }

    /// One incident of the organization.
    pub async fn get(&self, organization_id: i64, id: i64) -> Result<Incident> {
        let row: Option<IncidentRow> = sqlx::query_as(include_str!("service/sql/get.sql"))
            .bind(organization_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        incident(row.ok_or_else(|| Error::not_found("incident", id))?)
    }

    /// A page of the organization's incidents, newest number first.
    pub async fn list(
        &self,
        organization_id: i64,
        filter: &IncidentFilter,
    ) -> Result<Vec<Incident>> {
        let rows: Vec<IncidentRow> = sqlx::query_as(include_str!("service/sql/list.sql"))
            .bind(organization_id)
            .bind(filter.lifecycle.map(Lifecycle::as_str))
            .bind(filter.policy_id)
            .bind(filter.entity_id)
            .bind(filter.before)
            .bind(filter.limit()?)
            .fetch_all(&self.pool)
            .await?;
        rows.into_iter().map(incident).collect()
    }

    /// The incident's timeline: its events in position order.
    pub async fn timeline(&self, organization_id: i64, id: i64) -> Result<Vec<StoredEvent>> {
        self.get(organization_id, id).await?;
        let query = Query::items([QueryItem::new().tags([format!("incident:{id}")])])?;
        Ok(self.timeline.read(&query, ReadOptions::default()).await?)
    }

    /// The organization's events after position `after`, in order, never
    /// skipping one that commits late with a lower position: read through a
    /// catch-up [`pgonce::events::Subscription`]. Waits up to `wait` for the first
    /// event (long poll), polling every 100 ms. Returns the events (at most
    /// `limit`) and the position to pass as `after` next.
    ///
    /// Positions are shared by every organization, so a page examines
    /// `limit` positions at a time and moves on at once over other
    /// organizations' events. A gap (a position whose append is still
    /// running, or was rolled back) is looked at again every few
    /// milliseconds, even with `wait` zero, for up to [`FEED_GAP_WAIT`]:
    /// a rolled-back position is passed on the second look, so it never
    /// stalls a client that does not wait. Without an event, the page is
    /// empty and `next` the horizon reached.
    ///
    /// Because positions are global, a creation in flight in any
    /// organization holds every feed below its event's position until it
    /// commits or rolls back: one creation transaction, whose event is
    /// appended before it waits for its organization's number lock (so
    /// that wait, not the append, is what the number lock serializes).
    pub async fn feed(
        &self,
        organization_id: i64,
        after: i64,
        limit: i64,
        wait: Duration,
    ) -> Result<FeedPage> {
        if after < 0 {
            return Err(Error::invalid("after", "must not be negative"));
        }
        if !(1..=1000).contains(&limit) {
            return Err(Error::invalid("limit", "must be 1 to 1000"));
        }
        let query = Query::items([QueryItem::new().tags([format!("org:{organization_id}")])])?;
        let mut subscription = self
            .timeline
            .subscribe(pgonce::events::SubscriptionConfig {
                after,
                query,
                batch: limit,
                listen: pgonce::Listen::Off,
                ..Default::default()
            })
            .await?;
        let started = tokio::time::Instant::now();
        let deadline = started + wait;
        // Scanning other organizations' positions and settling gaps may
        // run past a short `wait`, up to this.
        let busy_deadline = deadline.max(started + FEED_GAP_WAIT);
        loop {
            let pgonce::events::PollOutcome {
                events,
                counters: polled,
                ..
            } = subscription.run_once().await?;
            let now = tokio::time::Instant::now();
            if !events.is_empty() {
                return Ok(FeedPage {
                    events,
                    next: subscription.horizon(),
                });
            }
            let pause = if polled.advanced > 0 {
                // Moved over other organizations' events: look further now.
                Duration::ZERO
            } else if polled.waiting_on_gap {
                FEED_GAP_RECHECK
            } else if now < deadline {
                Duration::from_millis(100).min(wait)
            } else {
                return Ok(FeedPage {
                    events,
                    next: subscription.horizon(),
                });
            };
            if now >= busy_deadline {
                return Ok(FeedPage {
                    events,
                    next: subscription.horizon(),
                });
            }
            tokio::time::sleep(pause).await;
        }
    }
}

/// A page of an organization's event feed ([`Service::feed`]).
#[derive(Debug, Clone)]
pub struct FeedPage {
    /// The organization's events, at most the page's limit, in position
    /// order; none when nothing came within the wait.
    pub events: Vec<StoredEvent>,
    /// The position to pass as `after` for the next page: the last
    /// event's, or the horizon reached without one.
    pub next: i64,
}
