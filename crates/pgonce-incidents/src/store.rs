//! Setting up: organizations, their API keys, entities, policies, and the
//! runtime settings. Plain single-statement reads and writes, except
//! [`set_entity_singleton`], which takes the entity's lock because the
//! guarded incident write reads what it changes.

use std::time::Duration;

use pgonce::IsolationLevel;
use rand::RngCore;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::{PgExecutor, PgPool};
use time::OffsetDateTime;

use crate::error::{Error, Result};
use crate::model::{Entity, Organization, Policy, Rule, Singleton, check_name};
use crate::service::entity_lock_key;

/// The setting that routes entities between the guarded and the plain
/// incident write, 0 to 100 (percent of entities on the guarded path).
pub const ROLLOUT_SETTING: &str = "guard_rollout_percent";

/// An organization as `store/sql/*organization*.sql` return it.
#[derive(sqlx::FromRow)]
struct OrgRow {
    id: i64,
    name: String,
    created_at: OffsetDateTime,
}

fn organization(
    OrgRow {
        id,
        name,
        created_at,
    }: OrgRow,
) -> Organization {
    Organization {
        id,
        name,
        created_at,
    }
}

/// Creates an organization and its first API key; returns both (the key in
/// plain text, the only time it is seen). [`Error::AlreadyExists`] if the
/// name is taken.
pub async fn create_organization(pool: &PgPool, name: &str) -> Result<(Organization, String)> {
    check_name("organization name", name)?;
    let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
    let row: Option<OrgRow> = sqlx::query_as(include_str!("store/sql/create_organization.sql"))
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
    let org = organization(row.ok_or(Error::AlreadyExists {
        what: "organization",
    })?);
    let key = insert_api_key(&mut *tx, org.id, "initial").await?;
    tx.commit().await?;
    Ok((org, key))
}

/// Organization `id`; [`Error::NotFound`] if there is none.
pub async fn get_organization(db: impl PgExecutor<'_>, id: i64) -> Result<Organization> {
    let row: Option<OrgRow> = sqlx::query_as(include_str!("store/sql/get_organization.sql"))
        .bind(id)
        .fetch_optional(db)
        .await?;
    row.map(organization)
        .ok_or_else(|| Error::not_found("organization", id))
}

/// The most rows a listing's page holds: its `limit` is 1 to this.
pub const MAX_PAGE: i64 = 500;

/// A listing's `limit`: 1 to [`MAX_PAGE`], else [`Error::Invalid`].
fn check_page_limit(limit: i64) -> Result<()> {
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(Error::invalid("limit", format!("must be 1 to {MAX_PAGE}")));
    }
    Ok(())
}

/// Organizations by id after `after_id`, at most `limit` (1 to
/// [`MAX_PAGE`]).
pub async fn list_organizations(
    db: impl PgExecutor<'_>,
    after_id: i64,
    limit: i64,
) -> Result<Vec<Organization>> {
    check_page_limit(limit)?;
    let rows: Vec<OrgRow> = sqlx::query_as(include_str!("store/sql/list_organizations.sql"))
        .bind(after_id)
        .bind(limit)
        .fetch_all(db)
        .await?;
    Ok(rows.into_iter().map(organization).collect())
}

/// A new API key for `organization_id`, returned in plain text once; only
/// its SHA-256 is stored.
pub async fn create_api_key(pool: &PgPool, organization_id: i64, name: &str) -> Result<String> {
    get_organization(pool, organization_id).await?;
    if name.chars().count() > crate::model::MAX_NAME {
        return Err(Error::invalid("key name", "at most 200 characters"));
    }
    insert_api_key(pool, organization_id, name).await
}

async fn insert_api_key(
    db: impl PgExecutor<'_>,
    organization_id: i64,
    name: &str,
) -> Result<String> {
    let mut prefix = [0u8; 6];
    let mut secret = [0u8; 32];
    {
        // The thread-local generator is not Send: dropped before any await,
        // so this future (and an HTTP handler awaiting it) stays Send.
        let mut rng = rand::rng();
        rng.fill_bytes(&mut prefix);
        rng.fill_bytes(&mut secret);
    }
    let prefix = hex::encode(prefix);
    let key = format!("pgo_{prefix}_{}", hex::encode(secret));
    sqlx::query(include_str!("store/sql/insert_api_key.sql"))
        .bind(organization_id)
        .bind(&prefix)
        .bind(Sha256::digest(key.as_bytes()).to_vec())
        .bind(name)
        .execute(db)
        .await?;
    Ok(key)
}

/// Revokes the organization's live key whose public prefix is `prefix` (the
/// 12 hex digits after `pgo_`); from then on [`authenticate`] refuses it.
/// [`Error::NotFound`] if the organization has no such live key.
pub async fn revoke_api_key(
    db: impl PgExecutor<'_>,
    organization_id: i64,
    prefix: &str,
) -> Result<()> {
    let done = sqlx::query(include_str!("store/sql/revoke_api_key.sql"))
        .bind(organization_id)
        .bind(prefix)
        .execute(db)
        .await?;
    if done.rows_affected() == 0 {
        return Err(Error::not_found("api key", prefix));
    }
    Ok(())
}

/// The public prefix of a key (`pgo_<prefix>_<secret>`), to name it in
/// [`revoke_api_key`]; `None` if `key` is not shaped like one.
pub fn api_key_prefix(key: &str) -> Option<&str> {
    let mut parts = key.splitn(3, '_');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("pgo"), Some(prefix), Some(_)) if prefix.len() == 12 => Some(prefix),
        _ => None,
    }
}

/// A live API key as `store/sql/authenticate.sql` returns it.
#[derive(sqlx::FromRow)]
struct ApiKeyRow {
    organization_id: i64,
    sha256: Vec<u8>,
}

/// The organization an API key belongs to; [`Error::Unauthorized`] for a
/// malformed, unknown or revoked key (the same error for each, so a caller
/// learns nothing about which).
pub async fn authenticate(db: impl PgExecutor<'_>, key: &str) -> Result<i64> {
    const REFUSED: Error = Error::Unauthorized("invalid API key");
    let mut parts = key.splitn(3, '_');
    let (Some("pgo"), Some(prefix), Some(secret)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(REFUSED);
    };
    if prefix.len() != 12 || secret.len() != 64 {
        return Err(REFUSED);
    }
    let row: Option<ApiKeyRow> = sqlx::query_as(include_str!("store/sql/authenticate.sql"))
        .bind(prefix)
        .fetch_optional(db)
        .await?;
    match row {
        // Digests of a 256-bit random secret: comparing them leaks nothing
        // an attacker could use to guess the secret.
        Some(ApiKeyRow {
            organization_id,
            sha256,
        }) if sha256 == Sha256::digest(key.as_bytes()).as_slice() => Ok(organization_id),
        _ => Err(REFUSED),
    }
}

/// An entity as `store/sql/*entit*.sql` return it.
#[derive(sqlx::FromRow)]
struct EntityRow {
    id: i64,
    organization_id: i64,
    external_id: String,
    attributes: Value,
    singleton_incidents: bool,
}

fn entity(
    EntityRow {
        id,
        organization_id,
        external_id,
        attributes,
        singleton_incidents,
    }: EntityRow,
) -> Entity {
    Entity {
        id,
        organization_id,
        external_id,
        attributes,
        singleton_incidents,
    }
}

/// Creates the entity `external_id` of the organization on first sight, or
/// records `attributes` as its latest, written so that its numbers read
/// back as they were given: a whole double is stored with a fraction
/// (`1e16` as `10000000000000000.0`), which `jsonb` keeps.
pub async fn upsert_entity(
    db: impl PgExecutor<'_>,
    organization_id: i64,
    external_id: &str,
    attributes: &Value,
) -> Result<Entity> {
    check_name("entity", external_id)?;
    crate::model::check_attributes(attributes)?;
    let row: EntityRow = sqlx::query_as(include_str!("store/sql/upsert_entity.sql"))
        .bind(organization_id)
        .bind(external_id)
        .bind(pgonce::json::stored(attributes))
        .fetch_one(db)
        .await
        .map_err(|e| unknown_organization(e, organization_id))?;
    Ok(entity(row))
}

/// Creates the entity `external_id` of the organization on first sight,
/// with no attributes (`{}`); an existing one is returned as it is, its
/// attributes (its latest observation's) kept. Writes nothing then, so it
/// neither waits for the entity's lock nor holds it.
pub async fn ensure_entity(
    pool: &PgPool,
    organization_id: i64,
    external_id: &str,
) -> Result<Entity> {
    check_name("entity", external_id)?;
    let created: Option<EntityRow> = sqlx::query_as(include_str!("store/sql/create_entity.sql"))
        .bind(organization_id)
        .bind(external_id)
        .fetch_optional(pool)
        .await
        .map_err(|e| unknown_organization(e, organization_id))?;
    match created {
        Some(row) => Ok(entity(row)),
        // Another statement, so another snapshot: an entity created by a
        // transaction that committed while the insert waited on it is
        // seen (entities are never deleted).
        None => find_entity(pool, organization_id, external_id).await,
    }
}

/// A foreign-key violation on organization_id becomes NotFound.
fn unknown_organization(e: sqlx::Error, organization_id: i64) -> Error {
    let fk = e
        .as_database_error()
        .is_some_and(|d| d.code().as_deref() == Some("23503"));
    if fk {
        Error::not_found("organization", organization_id)
    } else {
        e.into()
    }
}

/// Entity `id` of `organization_id`; [`Error::NotFound`] if that organization has
/// none by that id, another organization's entity included.
pub async fn get_entity(db: impl PgExecutor<'_>, organization_id: i64, id: i64) -> Result<Entity> {
    let row: Option<EntityRow> = sqlx::query_as(include_str!("store/sql/get_entity.sql"))
        .bind(organization_id)
        .bind(id)
        .fetch_optional(db)
        .await?;
    row.map(entity)
        .ok_or_else(|| Error::not_found("entity", id))
}

/// The entity of `organization_id` whose external id is `external_id`;
/// [`Error::NotFound`] if there is none.
pub async fn find_entity(
    db: impl PgExecutor<'_>,
    organization_id: i64,
    external_id: &str,
) -> Result<Entity> {
    let row: Option<EntityRow> = sqlx::query_as(include_str!("store/sql/find_entity.sql"))
        .bind(organization_id)
        .bind(external_id)
        .fetch_optional(db)
        .await?;
    row.map(entity)
        .ok_or_else(|| Error::not_found("entity", external_id))
}

/// Entities by id after `after_id`, at most `limit` (1 to [`MAX_PAGE`]).
pub async fn list_entities(
    db: impl PgExecutor<'_>,
    organization_id: i64,
    after_id: i64,
    limit: i64,
) -> Result<Vec<Entity>> {
    check_page_limit(limit)?;
    let rows: Vec<EntityRow> = sqlx::query_as(include_str!("store/sql/list_entities.sql"))
        .bind(organization_id)
        .bind(after_id)
        .bind(limit)
        .fetch_all(db)
        .await?;
    Ok(rows.into_iter().map(entity).collect())
}

/// Sets the entity's run-time singleton state, under the entity's lock: a
/// guarded incident write for this entity either re-reads the new value or
/// commits before it changes (READ COMMITTED, the lock held to commit).
/// Waits for the lock as long as its holder keeps it; see
/// [`set_entity_singleton_within`] for a bounded wait.
///
/// An entity of another organization is [`Error::NotFound`] before its
/// lock is taken (an entity never changes organization): the caller
/// neither waits for that organization's guarded writes, which would tell
/// it one is under way, nor holds them up.
pub async fn set_entity_singleton(
    pool: &PgPool,
    organization_id: i64,
    entity_id: i64,
    singleton: bool,
) -> Result<()> {
    set_singleton_under_lock(pool, organization_id, entity_id, singleton, None).await
}

/// [`set_entity_singleton`], waiting at most `lock_wait` for the entity's
/// lock (held by a guarded incident write of the entity until it commits,
/// or by any client changing what that write reads); past it
/// [`pgonce::Error::LockTimeout`], nothing written. What the API calls,
/// with [`crate::ServiceConfig::entity_lock_timeout`]: a request waiting
/// without a bound would hold its pooled connection, and a graceful stop,
/// as long as the holder takes.
pub async fn set_entity_singleton_within(
    pool: &PgPool,
    organization_id: i64,
    entity_id: i64,
    singleton: bool,
    lock_wait: Duration,
) -> Result<()> {
    set_singleton_under_lock(pool, organization_id, entity_id, singleton, Some(lock_wait)).await
}

async fn set_singleton_under_lock(
    pool: &PgPool,
    organization_id: i64,
    entity_id: i64,
    singleton: bool,
    lock_wait: Option<Duration>,
) -> Result<()> {
    get_entity(pool, organization_id, entity_id).await?;
    let mut tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
    let key = entity_lock_key(entity_id)?;
    let locked = match lock_wait {
        Some(wait) => pgonce::lock::lock_timeout(&mut tx, key, wait).await,
        None => pgonce::lock::lock(&mut tx, key).await,
    };
    if let Err(e) = locked {
        // The transaction ends now, not at the pooled connection's next use.
        let _ = tx.rollback().await;
        return Err(e.into());
    }
    let done = sqlx::query(include_str!("store/sql/set_entity_singleton.sql"))
        .bind(organization_id)
        .bind(entity_id)
        .bind(singleton)
        .execute(&mut *tx)
        .await?;
    if done.rows_affected() == 0 {
        return Err(Error::not_found("entity", entity_id));
    }
    tx.commit().await?;
    Ok(())
}

/// A policy as `store/sql/*polic*.sql` return it; `singleton` and `rule`
/// are parsed into their types by [`policy`].
#[derive(sqlx::FromRow)]
struct PolicyRow {
    id: i64,
    organization_id: i64,
    name: String,
    singleton: String,
    rule: Value,
}

fn policy(
    PolicyRow {
        id,
        organization_id,
        name,
        singleton,
        rule,
    }: PolicyRow,
) -> Result<Policy> {
    Ok(Policy {
        id,
        organization_id,
        name,
        singleton: singleton.parse()?,
        rule: serde_json::from_value(rule)
            .map_err(|e| Error::invalid("stored rule", e.to_string()))?,
    })
}

/// A new policy, as stored (its rule as every read of it answers);
/// [`Error::AlreadyExists`] if the organization has one of that name.
pub async fn create_policy(
    db: impl PgExecutor<'_>,
    organization_id: i64,
    name: &str,
    singleton: Singleton,
    rule: &Rule,
) -> Result<Policy> {
    check_name("policy name", name)?;
    rule.validate()?;
    // Written like attributes (`jsonb`); a rule stored before, whose value
    // jsonb prints as an integer, still reads back as its double (see
    // `Rule::value`).
    let rule_json = pgonce::json::stored(&serde_json::to_value(rule).expect("a rule serializes"));
    let row: Option<PolicyRow> = sqlx::query_as(include_str!("store/sql/create_policy.sql"))
        .bind(organization_id)
        .bind(name)
        .bind(singleton.as_str())
        .bind(rule_json)
        .fetch_optional(db)
        .await
        .map_err(|e| unknown_organization(e, organization_id))?;
    // The policy as stored, not as given: what every later read answers
    // (`-0.0` is stored as `jsonb`'s `0.0`, a numeric having no signed
    // zero).
    policy(row.ok_or(Error::AlreadyExists { what: "policy" })?)
}

/// The policies of `organization_id`, by id: all of them, as the
/// pipeline evaluates them. [`list_policies_page`] takes a page.
pub async fn list_policies(db: impl PgExecutor<'_>, organization_id: i64) -> Result<Vec<Policy>> {
    select_policies(db, organization_id, 0, i64::MAX).await
}

/// The policies of `organization_id` by id after `after_id`, at most
/// `limit` (1 to [`MAX_PAGE`]).
pub async fn list_policies_page(
    db: impl PgExecutor<'_>,
    organization_id: i64,
    after_id: i64,
    limit: i64,
) -> Result<Vec<Policy>> {
    check_page_limit(limit)?;
    select_policies(db, organization_id, after_id, limit).await
}

async fn select_policies(
    db: impl PgExecutor<'_>,
    organization_id: i64,
    after_id: i64,
    limit: i64,
) -> Result<Vec<Policy>> {
    let rows: Vec<PolicyRow> = sqlx::query_as(include_str!("store/sql/list_policies.sql"))
        .bind(organization_id)
        .bind(after_id)
        .bind(limit)
        .fetch_all(db)
        .await?;
    rows.into_iter().map(policy).collect()
}

/// Policy `id` of `organization_id`; [`Error::NotFound`] if that organization has
/// none by that id, another organization's policy included.
pub async fn get_policy(db: impl PgExecutor<'_>, organization_id: i64, id: i64) -> Result<Policy> {
    let row: Option<PolicyRow> = sqlx::query_as(include_str!("store/sql/get_policy.sql"))
        .bind(organization_id)
        .bind(id)
        .fetch_optional(db)
        .await?;
    policy(row.ok_or_else(|| Error::not_found("policy", id))?)
}

/// The share of entities (percent) whose incidents are written by the
/// guarded path; the rest take the plain two-transaction path.
pub async fn rollout_percent(db: impl PgExecutor<'_>) -> Result<u8> {
    let value: Option<Value> = sqlx::query_scalar(include_str!("store/sql/get_setting.sql"))
        .bind(ROLLOUT_SETTING)
        .fetch_optional(db)
        .await?;
    Ok(value
        .and_then(|v| v.as_u64())
        .map_or(100, |p| p.min(100) as u8))
}

/// Sets the rollout (0..=100); workers read it per message, so it takes
/// effect without a restart.
pub async fn set_rollout_percent(db: impl PgExecutor<'_>, percent: u8) -> Result<()> {
    if percent > 100 {
        return Err(Error::invalid("rollout", "must be 0 to 100"));
    }
    sqlx::query(include_str!("store/sql/set_setting.sql"))
        .bind(ROLLOUT_SETTING)
        .bind(Value::from(percent))
        .execute(db)
        .await?;
    tracing::info!(percent, "guard rollout changed");
    Ok(())
}
