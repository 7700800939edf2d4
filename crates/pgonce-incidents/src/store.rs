//! Reading and creating incidents. Creation goes through a pgonce guard:
//! the decision's read set is the policy's singleton-ness for the entity at
//! decision time plus, when it is a singleton, the ids of the OPEN
//! incidents; the write re-reads both under a per-entity lock and inserts
//! only if neither changed.

use pgonce::{Guard, GuardConfig, LockKey, ReadSet};
use sqlx::{PgConnection, PgPool};

/// The lock namespace of per-entity incident writes. Key: the entity id in
/// decimal.
pub const ENTITY_LOCK_NAMESPACE: &str = "pgonce-incidents/entity";

/// The guard every incident creation goes through (name `create-incident`,
/// READ COMMITTED, no lock timeout).
pub fn incident_guard() -> Guard {
    Guard::new("create-incident", GuardConfig::default()).expect("a valid constant config")
}

/// What a decision about one (policy, entity) saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub policy_id: i64,
    pub entity_id: i64,
    /// Whether the policy allowed at most one OPEN incident for this entity
    /// when read.
    pub singleton: bool,
    /// The OPEN incidents of this (policy, entity), ascending.
    pub open: Vec<i64>,
}

impl Observed {
    /// The read set the guard compares: the rule, and the open ids when the
    /// rule is "one at a time" (otherwise any number may be open and they do
    /// not matter to the decision).
    pub fn read_set(&self) -> ReadSet {
        if self.singleton {
            ReadSet::from_ids(self.open.iter().map(|id| format!("incident:{id}")))
                .with("rule:singleton", None)
        } else {
            ReadSet::new().with("rule:many", None)
        }
    }
}

async fn read(conn: &mut PgConnection, policy_id: i64, entity_id: i64) -> pgonce::Result<Observed> {
    let row: Option<(bool, Vec<i64>)> = sqlx::query_as(include_str!("store/sql/observe.sql"))
        .bind(policy_id)
        .bind(entity_id)
        .fetch_optional(conn)
        .await?;
    let (singleton, open) = row.ok_or_else(|| pgonce::Error::Invalid {
        what: "policy and entity",
        why: format!("no policy {policy_id} with entity {entity_id} in its organization"),
    })?;
    Ok(Observed {
        policy_id,
        entity_id,
        singleton,
        open,
    })
}

/// The decision's read, in a short transaction whose connection is back in
/// the pool when this returns.
pub async fn observe(pool: &PgPool, policy_id: i64, entity_id: i64) -> pgonce::Result<Observed> {
    let mut out = None;
    incident_guard()
        .read(pool, async |conn| {
            let observed = read(conn, policy_id, entity_id).await?;
            let set = observed.read_set();
            out = Some(observed);
            Ok(set)
        })
        .await?;
    Ok(out.expect("read ran"))
}

/// Creates an OPEN incident for `seen`'s (policy, entity) if what the
/// decision saw still holds: the policy's singleton-ness for the entity is
/// unchanged and, for a singleton, so is the set of OPEN incidents.
/// Otherwise returns [`pgonce::Error::Conflict`] and creates nothing. Returns
/// the new incident's id.
pub async fn create_incident(pool: &PgPool, seen: &Observed, summary: &str) -> pgonce::Result<i64> {
    let (policy_id, entity_id) = (seen.policy_id, seen.entity_id);
    let key = LockKey::new(ENTITY_LOCK_NAMESPACE, &entity_id.to_string())?;
    incident_guard()
        .write(
            pool,
            key,
            &seen.read_set(),
            async |conn| Ok(read(conn, policy_id, entity_id).await?.read_set()),
            async |conn| {
                let id: i64 = sqlx::query_scalar(include_str!("store/sql/insert_incident.sql"))
                    .bind(policy_id)
                    .bind(entity_id)
                    .bind(summary)
                    .fetch_one(conn)
                    .await?;
                Ok(id)
            },
        )
        .await
}

/// I1 checked in the database: (policy, entity, open count) for every
/// singleton pair with more than one OPEN incident. Empty when I1 holds.
pub async fn singleton_violations(pool: &PgPool) -> pgonce::Result<Vec<(i64, i64, i64)>> {
    Ok(
        sqlx::query_as(include_str!("store/sql/singleton_violations.sql"))
            .fetch_all(pool)
            .await?,
    )
}
