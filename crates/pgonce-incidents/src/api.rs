//! The HTTP API (axum): [`router`] serves an [`ApiState`].
//!
//! # Authentication and scope
//!
//! Organization routes (`/v1/entities`, `/v1/policies`, `/v1/incidents`,
//! `/v1/events`, `/v1/observations`) need `Authorization: Bearer pgo_...`,
//! an API key of one organization ([`store::authenticate`]: stored as
//! SHA-256, revocable), in one `Authorization` header: sent twice, the
//! header is 401, whatever it holds. Every read and write of such a route is made in the
//! key's organization: another organization's id is answered 404, exactly
//! like an id that does not exist, so a key learns nothing of other
//! organizations. Admin routes (`/v1/organizations`, `/v1/settings`) need
//! the configured admin token instead ([`ApiConfig::admin_token`]).
//!
//! # Errors
//!
//! Every error is JSON, `{"error": {"code": "...", "message": "..."}}`,
//! with a stable code ([`ApiError`]): 400 `malformed_json`, 401
//! `unauthorized`, 404 `not_found` / `no_route`, 405
//! `method_not_allowed`, 408 `request_timeout`
//! (a body not sent within [`ApiConfig::body_timeout`]), 409
//! `invalid_transition` / `already_exists` / `conflict`, 413
//! `payload_too_large` (bodies are limited to [`ApiConfig::body_limit`]),
//! 422 `invalid` (validation, wrong JSON types, unknown fields, a body that
//! is not an object, a name sent twice in one object, a number that cannot
//! be kept as sent, `1e400` or `1e-400`, a string escaping a lone surrogate,
//! `"\ud800"`, arrays and objects nested more than 127 deep, the body's
//! own object included, a reused idempotency key), 503 `busy` / `unavailable`
//! (their details only in the server's log) / `pooler` (the
//! misconfiguration and its fix) and 500 `internal` (details only in the
//! log). What the HTTP
//! layer itself refuses has the same body when served by [`serve`]: 400
//! `bad_request`, 431 `header_fields_too_large` (a request head over
//! [`MAX_HEAD`], a long request target included).
//!
//! The document at `/openapi.json` lists every route ([`openapi::ROUTES`]).

mod error;
mod extract;
pub mod openapi;
mod serve;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, delete, get, post, put};
use axum::{Json, Router};
use futures::future::BoxFuture;
use metrics_exporter_prometheus::PrometheusHandle;
use pgonce::service::Failure;
use pgonce::{Queue, SendMessage, Sent};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

pub use error::ApiError;
pub use extract::{Admin, Caller, JsonBody, OptionalJsonBody, PathParams, QueryParams};
pub use serve::{JsonErrors, MAX_HEAD, serve};

use crate::error::Error;
use crate::model::{
    Declaration, IncidentFilter, Lifecycle, MAX_NAME, MAX_TITLE, NAME_PATTERN, Observation, Rule,
    Singleton, TITLE_PATTERN, check_name,
};
use crate::service::{FeedPage, Service};
use crate::store;

/// The largest [`ApiConfig::body_limit`]: 16 MiB. A body is read whole into
/// memory before it is parsed, so the limit is what one request may hold
/// there. What a route keeps of it: an observation is queued whole, which
/// the queue bounds at [`pgonce::queue::MAX_BODY_BYTES`] (256 KiB); an
/// entity keeps its attributes, up to the body limit, read back in at most
/// [`crate::model::max_printed_attributes`] bytes.
pub const MAX_BODY_LIMIT: usize = 16 * 1024 * 1024;

/// Settings of the API.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The token admin routes require (`Authorization: Bearer <token>`),
    /// at least 16 bytes. Default `None`: admin routes refuse everyone.
    pub admin_token: Option<String>,
    /// Largest request body in bytes; larger ones get a JSON 413. Default
    /// 64 KiB; 1024 to [`MAX_BODY_LIMIT`].
    pub body_limit: usize,
    /// Longest long-poll wait of `GET /v1/events?wait=`; longer requests
    /// are shortened to it. Default 30 s.
    pub max_wait: Duration,
    /// How long a client may take to send a request's headers (and how long
    /// an idle connection stays open); then [`serve`] closes the
    /// connection. Default 10 s.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body, once its
    /// headers are in; then a JSON 408. Default 10 s.
    pub body_timeout: Duration,
    /// How long an answer's write may wait for a client that takes none
    /// of its bytes; then [`serve`] closes the connection. Default 10 s.
    pub write_timeout: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            admin_token: None,
            body_limit: 64 * 1024,
            max_wait: Duration::from_secs(30),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
        }
    }
}

impl ApiConfig {
    /// Checks the admin token (at least 16 bytes when set, no whitespace
    /// around it), the header, body and write
    /// timeouts (above zero) and the body limit (at least 1024 bytes);
    /// otherwise [`Error::Invalid`].
    pub fn validate(&self) -> crate::Result<()> {
        // A request's token is read trimmed (extract.rs), so a configured
        // token with whitespace around it could never be matched.
        if let Some(token) = &self.admin_token
            && (token.len() < 16 || token.trim() != token)
        {
            return Err(Error::Invalid {
                what: "admin token",
                why: "must be at least 16 bytes, without whitespace around it".into(),
            });
        }
        if self.header_timeout.is_zero()
            || self.body_timeout.is_zero()
            || self.write_timeout.is_zero()
        {
            return Err(Error::Invalid {
                what: "timeouts",
                why: "the header, body and write timeouts must be positive".into(),
            });
        }
        if !(1024..=MAX_BODY_LIMIT).contains(&self.body_limit) {
            return Err(Error::Invalid {
                what: "body limit",
                why: format!("must be 1024 to {MAX_BODY_LIMIT} bytes"),
            });
        }
        Ok(())
    }
}

type Ingest = dyn Fn(SendMessage) -> BoxFuture<'static, pgonce::Result<Sent>> + Send + Sync;

/// What the handlers share: the service, the observations queue, the
/// Prometheus handle and the configuration. Cheap to clone.
#[derive(Clone)]
pub struct ApiState {
    inner: Arc<Inner>,
}

struct Inner {
    service: Service,
    ingest: Box<Ingest>,
    fifo: bool,
    metrics: Option<PrometheusHandle>,
    admin_digest: Option<[u8; 32]>,
    config: ApiConfig,
    /// Raised by [`ApiState::stop_long_polls`]; never lowered.
    stopping: watch::Sender<bool>,
    /// Requests whose handler runs: [`ApiState::requests_under_way`].
    under_way: RequestsUnderWay,
    /// The `/readyz` probes answered 503 one after the other, if any
    /// ([`NotReady::log`]). A std mutex: held for no await.
    not_ready: std::sync::Mutex<pgonce::service::Failures>,
    /// The `/readyz` probe's statement under way, if any.
    probing: Probing,
}

impl ApiState {
    /// The state of an API on `service` whose `POST /v1/observations` sends
    /// to `observations` (any [`Queue`]; FIFO queues get the observation's
    /// group). `metrics`: what `/metrics` renders (404 without one).
    pub fn new<Q>(
        service: Service,
        observations: Q,
        metrics: Option<PrometheusHandle>,
        config: ApiConfig,
    ) -> crate::Result<ApiState>
    where
        Q: Queue + Clone + 'static,
    {
        config.validate()?;
        let fifo = observations.is_fifo();
        let ingest = Box::new(move |message: SendMessage| {
            let queue = observations.clone();
            Box::pin(async move { queue.send(message).await }) as BoxFuture<'static, _>
        });
        let admin_digest = config
            .admin_token
            .as_ref()
            .map(|t| Sha256::digest(t.as_bytes()).into());
        Ok(ApiState {
            inner: Arc::new(Inner {
                service,
                ingest,
                fifo,
                metrics,
                admin_digest,
                config,
                stopping: watch::Sender::new(false),
                under_way: RequestsUnderWay::default(),
                not_ready: std::sync::Mutex::default(),
                probing: Probing::default(),
            }),
        })
    }

    /// Ends every long poll of `GET /v1/events` under way, and makes later
    /// ones answer without waiting: each gets an empty page whose `next` is
    /// the position it asked from, so its client asks again (of another
    /// instance) and misses nothing. Call it when a stop begins, with
    /// [`serve`]'s shutdown: the graceful stop waits for every answer under
    /// way, and would otherwise wait out each poll, up to
    /// [`ApiConfig::max_wait`], before the caller went on to stop the rest.
    pub fn stop_long_polls(&self) {
        self.inner.stopping.send_replace(true);
    }

    /// The count of requests of [`router`] and [`operations_router`] on
    /// this state whose answer is not made yet: a stop that gives up on
    /// its drain says how many it abandoned. The handle holds nothing else
    /// of the state (not its queue).
    pub fn requests_under_way(&self) -> RequestsUnderWay {
        self.inner.under_way.clone()
    }

    /// The incident service the handlers call.
    pub fn service(&self) -> &Service {
        &self.inner.service
    }

    /// The settings the API was built with.
    pub fn config(&self) -> &ApiConfig {
        &self.inner.config
    }

    fn admin_digest(&self) -> Option<&[u8; 32]> {
        self.inner.admin_digest.as_ref()
    }
}

/// The API's routes on `state` (see the module docs). Serve it with
/// [`serve`] (header, body and write timeouts); tests call it in-process.
pub fn router(state: ApiState) -> Router {
    let limit = state.config().body_limit;
    Router::new()
        .route(
            "/v1/organizations",
            post(create_organization).get(list_organizations),
        )
        .route("/v1/organizations/{org_id}/keys", post(create_key))
        .route(
            "/v1/organizations/{org_id}/keys/{prefix}",
            delete(revoke_key),
        )
        .route("/v1/settings", get(get_settings).put(put_settings))
        .route("/v1/entities", post(upsert_entity).get(list_entities))
        .route("/v1/entities/{id}", get(get_entity))
        .route("/v1/entities/{id}/singleton", put(set_singleton))
        .route("/v1/policies", post(create_policy).get(list_policies))
        .route("/v1/policies/{id}", get(get_policy))
        .route("/v1/incidents", get(list_incidents).post(declare))
        .route("/v1/incidents/{id}", get(get_incident))
        .route(
            "/v1/incidents/{id}/acknowledge",
            change_to(Lifecycle::Acknowledged),
        )
        .route("/v1/incidents/{id}/resolve", change_to(Lifecycle::Resolved))
        .route("/v1/incidents/{id}/timeline", get(timeline))
        .route("/v1/events", get(events))
        .route("/v1/observations", post(ingest))
        .route("/openapi.json", get(openapi_document))
        .merge(operations())
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), under_way))
        .with_state(state)
}

/// How many requests of an [`ApiState`]'s routers have no answer yet
/// ([`ApiState::requests_under_way`]). Cheap to clone; every clone counts
/// the same requests.
#[derive(Debug, Clone, Default)]
pub struct RequestsUnderWay(Arc<std::sync::atomic::AtomicUsize>);

impl RequestsUnderWay {
    /// Requests whose answer is not made yet.
    pub fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Counts the request in [`ApiState::requests_under_way`] until its
/// answer is made, or its handler dropped.
async fn under_way(State(state): State<ApiState>, request: Request, next: Next) -> Response {
    /// One request on the count while it lives.
    struct Counted(RequestsUnderWay);
    impl Drop for Counted {
        fn drop(&mut self) {
            (self.0)
                .0
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let count = state.requests_under_way();
    count.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let _counted = Counted(count);
    next.run(request).await
}

/// Only `/metrics`, `/healthz` and `/readyz`: what a process without the
/// API (`pgonce worker`) serves, so its pipeline and notifier metrics can
/// be scraped and its readiness probed.
pub fn operations_router(state: ApiState) -> Router {
    operations()
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), under_way))
        .with_state(state)
}

fn operations() -> Router<ApiState> {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
}

type ApiResult<T> = Result<T, ApiError>;

async fn no_route() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no_route", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this route",
    )
}

/// A name that may also be empty (key names): same rules otherwise.
fn check_optional_name(what: &'static str, s: &str) -> ApiResult<()> {
    if s.is_empty() {
        Ok(())
    } else {
        Ok(check_name(what, s)?)
    }
}

/// A key's public prefix: 12 lowercase hex digits, what
/// [`store::api_key_prefix`] returns (anything else names no key).
pub const KEY_PREFIX_PATTERN: &str = "^[0-9a-f]{12}$";

/// What the API takes as an `Idempotency-Key`, for the OpenAPI document: visible
/// ASCII and inner spaces, no leading or trailing space (HTTP trims them).
pub const IDEMPOTENCY_KEY_PATTERN: &str = "^[!-~]([ -~]*[!-~])?$";

fn check_key_prefix(prefix: &str) -> ApiResult<()> {
    let ok = prefix.len() == 12
        && prefix
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "the key prefix must be 12 lowercase hex digits",
        ))
    }
}

/// A query's `after`: a position or id, not negative.
fn check_after(after: i64) -> ApiResult<()> {
    if after < 0 {
        return Err(ApiError::invalid("after must not be negative"));
    }
    Ok(())
}

// ---- admin ----

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct NewOrganization {
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    name: String,
}

async fn create_organization(
    _: Admin,
    State(state): State<ApiState>,
    JsonBody(body): JsonBody<NewOrganization>,
) -> ApiResult<Response> {
    let (organization, api_key) =
        store::create_organization(state.service().pool(), &body.name).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "organization": organization, "api_key": api_key })),
    )
        .into_response())
}

async fn list_organizations(
    _: Admin,
    State(state): State<ApiState>,
    QueryParams(page): QueryParams<IdPage>,
) -> ApiResult<Json<Value>> {
    let organizations =
        store::list_organizations(state.service().pool(), page.after()?, page.limit).await?;
    Ok(page.answer("organizations", organizations, |o| o.id))
}

#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
struct NewKey {
    #[serde(default)]
    #[schemars(length(max = MAX_NAME), pattern(NAME_PATTERN))]
    name: String,
}

async fn create_key(
    _: Admin,
    State(state): State<ApiState>,
    PathParams(org_id): PathParams<i64>,
    OptionalJsonBody(body): OptionalJsonBody<NewKey>,
) -> ApiResult<Response> {
    let body = body.unwrap_or_default();
    check_optional_name("key name", &body.name)?;
    let api_key = store::create_api_key(state.service().pool(), org_id, &body.name).await?;
    let prefix = store::api_key_prefix(&api_key).map(str::to_owned);
    Ok((
        StatusCode::CREATED,
        Json(json!({ "organization_id": org_id, "api_key": api_key, "prefix": prefix })),
    )
        .into_response())
}

async fn revoke_key(
    _: Admin,
    State(state): State<ApiState>,
    PathParams((org_id, prefix)): PathParams<(i64, String)>,
) -> ApiResult<StatusCode> {
    check_key_prefix(&prefix)?;
    store::revoke_api_key(state.service().pool(), org_id, &prefix).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Settings {
    #[serde(deserialize_with = "crate::model::integral")]
    #[schemars(with = "u8", range(max = 100))]
    rollout_percent: u8,
}

async fn get_settings(_: Admin, State(state): State<ApiState>) -> ApiResult<Json<Value>> {
    let percent = store::rollout_percent(state.service().pool()).await?;
    Ok(Json(json!({ "rollout_percent": percent })))
}

async fn put_settings(
    _: Admin,
    State(state): State<ApiState>,
    JsonBody(body): JsonBody<Settings>,
) -> ApiResult<Json<Value>> {
    store::set_rollout_percent(state.service().pool(), body.rollout_percent).await?;
    Ok(Json(json!({ "rollout_percent": body.rollout_percent })))
}

// ---- entities ----

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct NewEntity {
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    external_id: String,
    /// The entity's attributes, replacing those it has (`{}` empties
    /// them). Omitted: a new entity has none (`{}`), an existing one keeps
    /// its own, its latest observation's.
    #[serde(default, deserialize_with = "present")]
    #[schemars(with = "crate::model::AttributesSchema", transform = no_default)]
    attributes: Option<Value>,
}

/// Drops the `default` schemars derives from `#[serde(default)]`: `null`
/// for an omitted member, which is neither what is sent nor what is taken.
fn no_default(schema: &mut schemars::Schema) {
    schema.remove("default");
}

/// A member that is sent, `null` included (refused then as attributes that
/// are not an object): only an omitted one is `None`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// Creates the entity, or records its attributes; see [`NewEntity`].
async fn upsert_entity(
    caller: Caller,
    State(state): State<ApiState>,
    JsonBody(body): JsonBody<NewEntity>,
) -> ApiResult<Json<Value>> {
    let pool = state.service().pool();
    let org = caller.organization_id;
    let entity = match &body.attributes {
        Some(attributes) => store::upsert_entity(pool, org, &body.external_id, attributes).await?,
        None => store::ensure_entity(pool, org, &body.external_id).await?,
    };
    Ok(Json(json!(entity)))
}

/// A page of a listing by id (entities, policies, organizations): the
/// rows after id `after` (default 0), at most `limit` (1 to
/// [`store::MAX_PAGE`], default [`DEFAULT_PAGE`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdPage {
    #[serde(default)]
    after: i64,
    #[serde(default = "default_page")]
    limit: i64,
}

/// The rows a listing by id, or the event feed, answers when no `limit`
/// is given.
const DEFAULT_PAGE: i64 = 100;

fn default_page() -> i64 {
    DEFAULT_PAGE
}

impl IdPage {
    /// The page's `after`, checked ([`check_after`]); the store checks
    /// `limit`.
    fn after(&self) -> ApiResult<i64> {
        check_after(self.after)?;
        Ok(self.after)
    }

    /// The answer of a page of `rows` (in id order) under `list`, with
    /// `next_after`: the last row's id when the page is full, else null
    /// (this is the last page).
    fn answer<T: Serialize>(&self, list: &str, rows: Vec<T>, id: fn(&T) -> i64) -> Json<Value> {
        let next_after = (rows.len() as i64 == self.limit)
            .then(|| rows.last().map(id))
            .flatten();
        Json(json!({ list: rows, "next_after": next_after }))
    }
}

async fn list_entities(
    caller: Caller,
    State(state): State<ApiState>,
    QueryParams(page): QueryParams<IdPage>,
) -> ApiResult<Json<Value>> {
    let pool = state.service().pool();
    let entities =
        store::list_entities(pool, caller.organization_id, page.after()?, page.limit).await?;
    Ok(page.answer("entities", entities, |e| e.id))
}

async fn get_entity(
    caller: Caller,
    State(state): State<ApiState>,
    PathParams(id): PathParams<i64>,
) -> ApiResult<Json<Value>> {
    let entity = store::get_entity(state.service().pool(), caller.organization_id, id).await?;
    Ok(Json(json!(entity)))
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SingletonFlag {
    singleton: bool,
}

async fn set_singleton(
    caller: Caller,
    State(state): State<ApiState>,
    PathParams(id): PathParams<i64>,
    JsonBody(body): JsonBody<SingletonFlag>,
) -> ApiResult<Json<Value>> {
    let pool = state.service().pool();
    let lock_wait = state.service().config().entity_lock_timeout;
    store::set_entity_singleton_within(pool, caller.organization_id, id, body.singleton, lock_wait)
        .await?;
    let entity = store::get_entity(pool, caller.organization_id, id).await?;
    Ok(Json(json!(entity)))
}

// ---- policies ----

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct NewPolicy {
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    name: String,
    singleton: Singleton,
    rule: Rule,
}

async fn create_policy(
    caller: Caller,
    State(state): State<ApiState>,
    JsonBody(body): JsonBody<NewPolicy>,
) -> ApiResult<Response> {
    let policy = store::create_policy(
        state.service().pool(),
        caller.organization_id,
        &body.name,
        body.singleton,
        &body.rule,
    )
    .await?;
    Ok((StatusCode::CREATED, Json(json!(policy))).into_response())
}

async fn list_policies(
    caller: Caller,
    State(state): State<ApiState>,
    QueryParams(page): QueryParams<IdPage>,
) -> ApiResult<Json<Value>> {
    let pool = state.service().pool();
    let policies =
        store::list_policies_page(pool, caller.organization_id, page.after()?, page.limit).await?;
    Ok(page.answer("policies", policies, |p| p.id))
}

async fn get_policy(
    caller: Caller,
    State(state): State<ApiState>,
    PathParams(id): PathParams<i64>,
) -> ApiResult<Json<Value>> {
    let policy = store::get_policy(state.service().pool(), caller.organization_id, id).await?;
    Ok(Json(json!(policy)))
}

// ---- incidents ----

async fn list_incidents(
    caller: Caller,
    State(state): State<ApiState>,
    QueryParams(filter): QueryParams<IncidentFilter>,
) -> ApiResult<Json<Value>> {
    let limit = filter.limit()?;
    let incidents = state
        .service()
        .list(caller.organization_id, &filter)
        .await?;
    let next_before = (incidents.len() as i64 == limit)
        .then(|| incidents.last().map(|i| i.number))
        .flatten();
    Ok(Json(
        json!({ "incidents": incidents, "next_before": next_before }),
    ))
}

/// `POST /v1/incidents`: a [`Declaration`] plus who declares it.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct NewDeclaration {
    #[schemars(length(min = 1, max = MAX_TITLE), pattern(TITLE_PATTERN))]
    title: String,
    #[serde(default)]
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    entity: Option<String>,
    #[serde(default)]
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    idempotency_key: Option<String>,
    #[serde(default)]
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    actor: Option<String>,
}

const DEFAULT_ACTOR: &str = "api";

/// The `Idempotency-Key` header: visible ASCII, not empty. An empty key is
/// refused, never taken as a key every request sending one would share.
/// (Declarations check its length like the body's key; observations hash a
/// long one into the queue's deduplication id.)
///
/// Sent more than once, it is refused: which of the keys would be the
/// request's is a guess, and a retry sending another of them would run the
/// request again.
fn idempotency_header(headers: &HeaderMap) -> ApiResult<Option<String>> {
    let mut values = headers.get_all("idempotency-key").iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::invalid(
            "the Idempotency-Key header must be sent once",
        ));
    }
    let key = value
        .to_str()
        .ok()
        .filter(|k| !k.chars().any(char::is_control))
        .ok_or_else(|| ApiError::invalid("the Idempotency-Key header must be visible ASCII"))?;
    if key.is_empty() {
        return Err(ApiError::invalid(
            "the Idempotency-Key header must not be empty",
        ));
    }
    Ok(Some(key.to_owned()))
}

async fn declare(
    caller: Caller,
    State(state): State<ApiState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<NewDeclaration>,
) -> ApiResult<Response> {
    let header_key = idempotency_header(&headers)?;
    let idempotency_key = match (header_key, body.idempotency_key) {
        (Some(h), Some(b)) if h != b => {
            return Err(ApiError::invalid(
                "the Idempotency-Key header and the body's idempotency_key differ",
            ));
        }
        (h, b) => h.or(b),
    };
    let declaration = Declaration {
        title: body.title,
        entity: body.entity,
        idempotency_key,
    };
    let actor = body.actor.unwrap_or_else(|| DEFAULT_ACTOR.to_owned());
    let incident = state
        .service()
        .declare(caller.organization_id, &declaration, &actor)
        .await?;
    Ok((StatusCode::CREATED, Json(json!(incident))).into_response())
}

async fn get_incident(
    caller: Caller,
    State(state): State<ApiState>,
    PathParams(id): PathParams<i64>,
) -> ApiResult<Json<Value>> {
    let incident = state.service().get(caller.organization_id, id).await?;
    Ok(Json(json!(incident)))
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Action {
    #[serde(default)]
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    actor: Option<String>,
}

fn actor(body: Option<Action>) -> ApiResult<String> {
    let actor = body
        .and_then(|a| a.actor)
        .unwrap_or_else(|| DEFAULT_ACTOR.to_owned());
    check_name("actor", &actor)?;
    Ok(actor)
}

/// `POST /v1/incidents/{id}/acknowledge` and `.../resolve`: one
/// conditional transition ([`Service::acknowledge`], [`Service::resolve`]);
/// from a state that does not allow it, 409 `invalid_transition`.
async fn change_lifecycle(
    caller: Caller,
    State(state): State<ApiState>,
    PathParams(id): PathParams<i64>,
    OptionalJsonBody(body): OptionalJsonBody<Action>,
    to: Lifecycle,
) -> ApiResult<Json<Value>> {
    let actor = actor(body)?;
    let service = state.service();
    let incident = match to {
        Lifecycle::Acknowledged => {
            service
                .acknowledge(caller.organization_id, id, &actor)
                .await?
        }
        _ => service.resolve(caller.organization_id, id, &actor).await?,
    };
    Ok(Json(json!(incident)))
}

/// The route handler moving an incident to `to`.
fn change_to(to: Lifecycle) -> MethodRouter<ApiState> {
    post(
        move |caller: Caller,
              state: State<ApiState>,
              id: PathParams<i64>,
              body: OptionalJsonBody<Action>| {
            change_lifecycle(caller, state, id, body, to)
        },
    )
}

async fn timeline(
    caller: Caller,
    State(state): State<ApiState>,
    PathParams(id): PathParams<i64>,
) -> ApiResult<Json<Value>> {
    let events = state.service().timeline(caller.organization_id, id).await?;
    Ok(Json(json!({ "events": events })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FeedParams {
    #[serde(default)]
    after: i64,
    /// Seconds to wait for a first event (long poll).
    #[serde(default)]
    wait: u64,
    #[serde(default = "default_page")]
    limit: i64,
}

async fn events(
    caller: Caller,
    State(state): State<ApiState>,
    QueryParams(params): QueryParams<FeedParams>,
) -> ApiResult<Json<Value>> {
    check_after(params.after)?;
    let mut stopping = state.inner.stopping.subscribe();
    let wait = if *stopping.borrow_and_update() {
        Duration::ZERO
    } else {
        Duration::from_secs(params.wait).min(state.config().max_wait)
    };
    let feed = state
        .service()
        .feed(caller.organization_id, params.after, params.limit, wait);
    let page = tokio::select! {
        read = feed => read?,
        // A stop ends the wait. The feed only reads, so dropping it leaves
        // nothing behind; `next` = `after` is a horizon the page reached,
        // and the client's next poll reads everything after it.
        Ok(_) = stopping.wait_for(|s| *s), if !wait.is_zero() => FeedPage {
            events: Vec::new(),
            next: params.after,
        },
    };
    Ok(Json(json!({ "events": page.events, "next": page.next })))
}

// ---- ingest ----

async fn ingest(
    caller: Caller,
    State(state): State<ApiState>,
    headers: HeaderMap,
    JsonBody(observation): JsonBody<Observation>,
) -> ApiResult<Response> {
    observation.validate()?;
    if observation.organization_id != caller.organization_id {
        // Another organization's id is reported like an unknown one.
        return Err(Error::NotFound {
            what: "organization",
            id: observation.organization_id.to_string(),
        }
        .into());
    }
    let mut message = SendMessage::new(observation.queue_body());
    if state.inner.fifo {
        message = message.group(observation.group());
    }
    // The header, else the producer's own message id, deduplicates resends
    // within the queue's window (the pipeline catches later ones by id).
    let key = idempotency_header(&headers)?.or_else(|| observation.message_id.clone());
    if let Some(key) = key {
        message = message.dedup(observation.dedup_id(&key));
    }
    let sent = (state.inner.ingest)(message).await.map_err(Error::from)?;
    metrics::counter!("pgonce_incidents_api_observations_total").increment(1);
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "message_id": sent.id, "duplicate": sent.duplicate })),
    )
        .into_response())
}

// ---- operations ----

async fn metrics(State(state): State<ApiState>) -> ApiResult<Response> {
    let handle = state
        .inner
        .metrics
        .as_ref()
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "no_route", "metrics are off"))?;
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response())
}

async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// How long `/readyz` waits for the database: a probe must hear back
/// within a second, however long API calls wait for a connection.
pub const READY_WITHIN: Duration = Duration::from_millis(800);

/// What `/readyz` reads of the database: whether it takes writes now.
/// Read, never tried with a write: a probe stays one cheap statement that
/// changes nothing.
///
/// It does not ask whether a newer build migrated the database since this
/// process started. In a rolling deploy the first new process migrates
/// while the old ones still serve: were they all unready at that instant,
/// the load balancer would send the whole traffic to that one process. A
/// process refuses a newer schema at start only; a migration the previous
/// build cannot run beside (the CHANGELOG names it) needs the old
/// processes stopped first.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
struct Writability {
    /// `pg_is_in_recovery()`: a standby (or a server still recovering),
    /// which refuses every write.
    in_recovery: bool,
    /// `transaction_read_only` of the probe's own transaction: on for a
    /// standby, and where `default_transaction_read_only` is on for the
    /// server, the database or the service's role.
    read_only: bool,
}

/// Why a `/readyz` probe answered 503: its answer's message, and the
/// `reason` label of `pgonce_incidents_not_ready_probes_total`.
#[derive(Debug, Clone, Copy)]
enum NotReady {
    /// The probe's statement failed or did not answer within
    /// [`READY_WITHIN`].
    NoAnswer,
    /// `pg_is_in_recovery()`.
    Standby,
    /// `transaction_read_only`.
    ReadOnly,
}

impl NotReady {
    fn message(self) -> &'static str {
        match self {
            NotReady::NoAnswer => "the database does not answer",
            NotReady::Standby => "the database is a standby and refuses writes",
            NotReady::ReadOnly => "the database is read-only and refuses writes",
        }
    }

    fn label(self) -> &'static str {
        match self {
            NotReady::NoAnswer => "no_answer",
            NotReady::Standby => "standby",
            NotReady::ReadOnly => "read_only",
        }
    }

    /// Counts the probe and logs it as pgonce's loops log failed passes
    /// (`pgonce::service`): the first of a run at warn with `detail`, then
    /// a warn line a minute at most while probes go on answering 503, the
    /// others at debug. Load balancers probe every few seconds each: a line
    /// per probe filled the log for as long as the database was away.
    fn log(self, state: &ApiState, detail: &dyn std::fmt::Display) -> ApiError {
        metrics::counter!("pgonce_incidents_not_ready_probes_total", "reason" => self.label())
            .increment(1);
        let what = state
            .inner
            .not_ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .failed(tokio::time::Instant::now(), time::OffsetDateTime::now_utc());
        let message = self.message();
        match what {
            Failure::First => tracing::warn!(error = %detail, "not ready: {message}"),
            Failure::StillFailing(run) => {
                tracing::warn!(failed = run.count, since = %run.since, error = %detail,
                "still not ready: {} probes answered 503 since {}; now {message}", run.count, run.since)
            }
            Failure::Quiet => tracing::debug!(error = %detail, "not ready: {message}"),
        }
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }
}

/// How long `/readyz`'s statement may run on a connection it has, before
/// it is given up: a connection that does not answer (a network that drops
/// its packets) would otherwise keep the probe under way, which later
/// probes wait for, for good.
const PROBE_STATEMENT_AT_MOST: Duration = Duration::from_secs(30);

/// What `/readyz`'s statement answered: the database's writability, or
/// why there is none.
type Probed = Result<Writability, String>;

/// `/readyz`'s statement, run in a task of its own, one at a time.
///
/// A probe waits [`READY_WITHIN`] for the answer, and getting it may take
/// longer: on a pool with no idle connection (none opened yet, or all
/// closed with a server that restarted or idled out) the statement opens
/// one first, over a distant network, TLS, a slow login or a loaded
/// machine. Run in the probe's own future, that connect was dropped with
/// it and the next probe began another: when opening one took longer than
/// the bound, no probe ever answered 200, and a process that nothing else
/// kept connected (an API-only `serve`, taken out of the load balancer's
/// rotation) stayed unready for good. In a task, the connect goes on past
/// the probe that began it, as long as the pool's acquire timeout allows,
/// and the connection goes to the pool, where the next probe finds it. A
/// probe that comes while one is under way waits for that one's answer,
/// so the probes hold one connection of the pool at most.
#[derive(Default)]
struct Probing(std::sync::Mutex<Option<watch::Receiver<Option<Probed>>>>);

impl Probing {
    /// The answer of the probe under way on `pool`, or of one started now.
    /// A std mutex: held for no await.
    fn answer(&self, pool: &sqlx::PgPool) -> watch::Receiver<Option<Probed>> {
        let mut under_way = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Under way: not answered yet, and its task still there to answer.
        if let Some(answer) = under_way
            .as_ref()
            .filter(|a| a.borrow().is_none() && a.has_changed().is_ok())
        {
            return answer.clone();
        }
        let (answered, answer) = watch::channel(None);
        let pool = pool.clone();
        tokio::spawn(async move {
            answered.send_replace(Some(probe(&pool).await));
        });
        *under_way = Some(answer.clone());
        answer
    }
}

/// Reads the database's writability on a connection of `pool`: one
/// statement that writes nothing.
async fn probe(pool: &sqlx::PgPool) -> Probed {
    let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
    let statement = sqlx::query_as::<_, Writability>(
        "SELECT pg_is_in_recovery() AS in_recovery, \
                current_setting('transaction_read_only')::boolean AS read_only",
    )
    .fetch_one(&mut *conn);
    match tokio::time::timeout(PROBE_STATEMENT_AT_MOST, statement).await {
        Ok(answer) => answer.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "no answer within {PROBE_STATEMENT_AT_MOST:?} on an open connection"
        )),
    }
}

async fn readyz(State(state): State<ApiState>) -> ApiResult<Json<Value>> {
    let mut probed = state.inner.probing.answer(state.service().pool());
    let writability =
        match tokio::time::timeout(READY_WITHIN, probed.wait_for(Option::is_some)).await {
            Ok(Ok(answer)) => answer.clone().expect("waited for an answer"),
            Ok(Err(_)) => Err("the probe's task ended without an answer".to_owned()),
            Err(_) => Err(format!("no answer within {READY_WITHIN:?}")),
        }
        .map_err(|e| NotReady::NoAnswer.log(&state, &e))?;
    // Every write would answer 503 `unavailable` (SQLSTATE 25006): not a
    // server to send traffic to until it takes writes again.
    if writability.in_recovery {
        return Err(NotReady::Standby.log(&state, &"pg_is_in_recovery() is true"));
    }
    if writability.read_only {
        return Err(NotReady::ReadOnly.log(
            &state,
            &"transaction_read_only is on: default_transaction_read_only of the server, \
              database or role",
        ));
    }
    let ended = state
        .inner
        .not_ready
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .succeeded();
    if let Some(run) = ended {
        tracing::info!(failed = run.count, since = %run.since,
            "ready again after {} probes answered 503 since {}", run.count, run.since);
    }
    Ok(Json(json!({ "status": "ready" })))
}

async fn openapi_document() -> Json<Value> {
    Json(openapi::document())
}
