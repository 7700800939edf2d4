//! The HTTP API, driven in-process (`tower::ServiceExt::oneshot`) against a
//! fresh database per test: every route, authentication (missing, wrong,
//! revoked, admin), cross-organization access (a foreign id is 404 and
//! changes nothing), malformed and hostile input (JSON errors, nothing
//! half-written), pagination and the event feed.

use std::collections::BTreeSet;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use metrics_exporter_prometheus::PrometheusBuilder;
use pgonce::{PgQueue, Queue, ReceiveRequest};
use pgonce_incidents::api::{ApiConfig, ApiState, openapi, router};
use pgonce_incidents::model::{Observation, PRINTED_ATTRIBUTES_ALLOWANCE};
use pgonce_incidents::runtime::observations_queue;
use pgonce_incidents::{Service, ServiceConfig};
use pgonce_testkit::{Interleaving, ScratchDatabase};
use serde_json::{Value, json};
use sqlx::PgPool;
use tower::ServiceExt;

const ADMIN: &str = "test-admin-token-0123456789";

struct Api {
    router: Router,
    pool: PgPool,
    queue: PgQueue,
    _db: ScratchDatabase,
}

struct Answer {
    status: StatusCode,
    body: Value,
    content_type: String,
}

impl Answer {
    fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("<none>")
    }
}

async fn api_with(config: ApiConfig, metrics: bool) -> Api {
    let (db, pool) = pgonce_testkit::fresh_migrated_database(8, pgonce_incidents::migrate).await;
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let queue = observations_queue(&pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let metrics = metrics.then(|| PrometheusBuilder::new().build_recorder().handle());
    let state = ApiState::new(service, queue.clone(), metrics, config).unwrap();
    Api {
        router: router(state),
        pool,
        queue,
        _db: db,
    }
}

async fn setup() -> Api {
    let config = ApiConfig {
        admin_token: Some(ADMIN.into()),
        ..ApiConfig::default()
    };
    api_with(config, true).await
}

impl Api {
    async fn raw(&self, request: Request<Body>) -> Answer {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let body = if content_type.starts_with("application/json") {
            serde_json::from_slice(&bytes).unwrap()
        } else {
            Value::String(String::from_utf8_lossy(&bytes).into_owned())
        };
        Answer {
            status,
            body,
            content_type,
        }
    }

    async fn send(&self, method: Method, uri: &str, auth: Option<&str>, body: Body) -> Answer {
        let mut request = Request::builder().method(method).uri(uri);
        if let Some(token) = auth {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request
            .header(header::CONTENT_TYPE, "application/json")
            .body(body)
            .unwrap();
        self.raw(request).await
    }

    async fn get(&self, uri: &str, auth: &str) -> Answer {
        self.send(Method::GET, uri, Some(auth), Body::empty()).await
    }

    async fn post(&self, uri: &str, auth: &str, body: Value) -> Answer {
        self.send(Method::POST, uri, Some(auth), Body::from(body.to_string()))
            .await
    }

    async fn put(&self, uri: &str, auth: &str, body: Value) -> Answer {
        self.send(Method::PUT, uri, Some(auth), Body::from(body.to_string()))
            .await
    }

    async fn delete(&self, uri: &str, auth: &str) -> Answer {
        self.send(Method::DELETE, uri, Some(auth), Body::empty())
            .await
    }

    /// A request with an `Idempotency-Key` header.
    async fn post_with_key(&self, uri: &str, auth: &str, key: &str, body: Value) -> Answer {
        let request = Request::post(uri)
            .header(header::AUTHORIZATION, format!("Bearer {auth}"))
            .header("Idempotency-Key", key)
            .body(Body::from(body.to_string()))
            .unwrap();
        self.raw(request).await
    }

    /// A new organization through the admin route: (id, key).
    async fn organization(&self, name: &str) -> (i64, String) {
        let a = self
            .post("/v1/organizations", ADMIN, json!({ "name": name }))
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        (
            a.body["organization"]["id"].as_i64().unwrap(),
            a.body["api_key"].as_str().unwrap().to_owned(),
        )
    }

    async fn declare(&self, key: &str, title: &str) -> Value {
        let a = self
            .post("/v1/incidents", key, json!({ "title": title }))
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        a.body
    }

    /// Stores `attributes` on the organization's first entity and checks
    /// that they read back equal, in the write's answer and the listing.
    async fn assert_attributes_read_back(&self, key: &str, attributes: &Value) {
        let body = json!({"external_id": "db-1", "attributes": attributes});
        let a = self.post("/v1/entities", key, body).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        assert_eq!(a.body["attributes"], *attributes);
        let a = self.get("/v1/entities", key).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        assert_eq!(a.body["entities"][0]["attributes"], *attributes);
    }

    /// Creates the organization's first policy, its rule comparing with
    /// `value`, and checks that the value reads back equal in the listing.
    async fn assert_rule_value_reads_back(&self, key: &str, value: &Value) {
        let rule = json!({"attribute": "x", "op": "gt", "value": value});
        let body = json!({"name": "p", "singleton": "never", "rule": rule});
        let a = self.post("/v1/policies", key, body).await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        let a = self.get("/v1/policies", key).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        assert_eq!(a.body["policies"][0]["rule"]["value"], *value);
    }

    /// Sends `attributes` (JSON text) as the attributes of the entity
    /// `db-1`, then in an observation of it: each route with its answer.
    async fn send_attributes(
        &self,
        org: i64,
        key: &str,
        attributes: &str,
    ) -> Vec<(&'static str, Answer)> {
        let mut answers = Vec::new();
        for (uri, body) in [
            (
                "/v1/entities",
                format!(r#"{{"external_id": "db-1", "attributes": {attributes}}}"#),
            ),
            (
                "/v1/observations",
                format!(
                    r#"{{"organization_id": {org}, "entity": "db-1", "attributes": {attributes}}}"#
                ),
            ),
        ] {
            let a = self
                .send(Method::POST, uri, Some(key), Body::from(body))
                .await;
            answers.push((uri, a));
        }
        answers
    }

    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap()
    }
}

fn id(v: &Value) -> i64 {
    v["id"].as_i64().unwrap()
}

fn numbers(a: &Answer) -> Vec<i64> {
    a.body["incidents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["number"].as_i64().unwrap())
        .collect()
}

#[tokio::test]
async fn admin_routes_need_the_admin_token() {
    let api = setup().await;
    let body = || Body::from(json!({"name": "acme"}).to_string());
    for auth in [None, Some("wrong-token"), Some("")] {
        let a = api
            .send(Method::POST, "/v1/organizations", auth, body())
            .await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{auth:?}");
        assert_eq!(a.code(), "unauthorized");
    }
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.organizations")
            .await,
        0
    );

    let (org, key) = api.organization("acme").await;
    assert!(key.starts_with("pgo_"));
    // An organization's key is not the admin token.
    let a = api.get("/v1/organizations", &key).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    let a = api.get("/v1/organizations", ADMIN).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body["organizations"][0]["id"], org);
    // The name is unique.
    let a = api
        .post("/v1/organizations", ADMIN, json!({"name": "acme"}))
        .await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::CONFLICT, "already_exists")
    );

    // More keys; an unknown organization is 404.
    let a = api
        .post(
            &format!("/v1/organizations/{org}/keys"),
            ADMIN,
            json!({"name": "ci"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let second = a.body["api_key"].as_str().unwrap().to_owned();
    assert_eq!(
        api.get("/v1/policies", &second).await.status,
        StatusCode::OK
    );
    let a = api
        .post("/v1/organizations/999999/keys", ADMIN, json!({}))
        .await;
    assert_eq!((a.status, a.code()), (StatusCode::NOT_FOUND, "not_found"));

    // Settings: the rollout, validated, changed without a restart.
    let a = api.get("/v1/settings", ADMIN).await;
    assert_eq!(a.body, json!({"rollout_percent": 100}));
    let a = api
        .put("/v1/settings", ADMIN, json!({"rollout_percent": 30}))
        .await;
    assert_eq!(a.status, StatusCode::OK);
    for bad in [
        json!({"rollout_percent": 101}),
        json!({"rollout_percent": -1}),
        json!({"rollout_percent": "50"}),
        json!({}),
    ] {
        let a = api.put("/v1/settings", ADMIN, bad.clone()).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
            "{bad}"
        );
    }
    assert_eq!(
        api.get("/v1/settings", ADMIN).await.body,
        json!({"rollout_percent": 30})
    );
    let a = api
        .put("/v1/settings", &key, json!({"rollout_percent": 0}))
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        pgonce_incidents::store::rollout_percent(&api.pool)
            .await
            .unwrap(),
        30
    );
}

#[tokio::test]
async fn without_a_configured_admin_token_admin_routes_refuse_everyone() {
    let api = api_with(ApiConfig::default(), false).await;
    for token in ["", "x", ADMIN] {
        let a = api
            .post("/v1/organizations", token, json!({"name": "a"}))
            .await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{token:?}");
    }
    // Without a Prometheus handle, /metrics is not served.
    assert_eq!(api.get("/metrics", "").await.status, StatusCode::NOT_FOUND);
    // A short admin token is a configuration error.
    let service = Service::new(api.pool.clone(), ServiceConfig::default()).unwrap();
    let short = ApiConfig {
        admin_token: Some("short".into()),
        ..ApiConfig::default()
    };
    assert!(ApiState::new(service, api.queue.clone(), None, short).is_err());
}

#[tokio::test]
async fn api_keys_authenticate_and_missing_wrong_or_revoked_keys_are_401() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    assert_eq!(api.get("/v1/incidents", &key).await.status, StatusCode::OK);

    let a = api
        .send(Method::GET, "/v1/incidents", None, Body::empty())
        .await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    let mut wrong = key.clone();
    wrong.replace_range(wrong.len() - 4.., "0000");
    for token in [
        wrong.as_str(),
        "pgo_",
        "pgo_abc_def",
        ADMIN,
        "x'; DROP TABLE incidents.api_keys; --",
    ] {
        let a = api.get("/v1/incidents", token).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::UNAUTHORIZED, "unauthorized"),
            "{token}"
        );
    }
    let request = Request::get("/v1/incidents")
        .header(header::AUTHORIZATION, format!("Basic {key}"))
        .body(Body::empty())
        .unwrap();
    assert_eq!(api.raw(request).await.status, StatusCode::UNAUTHORIZED);

    // Revoked: the key stops working, the organization's other key does not.
    let second = api
        .post(&format!("/v1/organizations/{org}/keys"), ADMIN, json!({}))
        .await
        .body["api_key"]
        .as_str()
        .unwrap()
        .to_owned();
    let prefix = pgonce_incidents::store::api_key_prefix(&key).unwrap();
    let revoke = format!("/v1/organizations/{org}/keys/{prefix}");
    assert_eq!(
        api.delete(&revoke, &key).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        api.delete(&revoke, ADMIN).await.status,
        StatusCode::NO_CONTENT
    );
    let a = api.get("/v1/incidents", &key).await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    assert_eq!(
        api.get("/v1/incidents", &second).await.status,
        StatusCode::OK
    );
    // Revoking twice, or through another organization, is 404.
    assert_eq!(
        api.delete(&revoke, ADMIN).await.status,
        StatusCode::NOT_FOUND
    );
    let (other, _) = api.organization("other").await;
    let second_prefix = pgonce_incidents::store::api_key_prefix(&second).unwrap();
    let a = api
        .delete(
            &format!("/v1/organizations/{other}/keys/{second_prefix}"),
            ADMIN,
        )
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(
        api.get("/v1/incidents", &second).await.status,
        StatusCode::OK
    );
}

/// Credentials sent twice (two `Authorization` headers) are 401, whoever's
/// they are, with nothing read or written: which of them the request is
/// made with would be a guess, and the first one had been taken, so a
/// request carrying one organization's key after another's was made in
/// the first's. The same as an `Idempotency-Key` sent twice.
#[tokio::test]
async fn credentials_sent_twice_are_refused() {
    let api = setup().await;
    let (_, first) = api.organization("acme").await;
    let (_, second) = api.organization("other").await;
    let twice = |method: Method, uri: &str, keys: [&str; 2], body: Body| {
        Request::builder()
            .method(method)
            .uri(uri)
            .header(header::AUTHORIZATION, format!("Bearer {}", keys[0]))
            .header(header::AUTHORIZATION, format!("Bearer {}", keys[1]))
            .body(body)
            .unwrap()
    };
    let mut answers = Vec::new();
    for keys in [[&*first, &*second], [&*first, &*first]] {
        let a = api
            .raw(twice(Method::GET, "/v1/incidents", keys, Body::empty()))
            .await;
        answers.push(("GET /v1/incidents", a));
        let declaration = json!({"title": "db down"}).to_string();
        let a = api
            .raw(twice(
                Method::POST,
                "/v1/incidents",
                keys,
                Body::from(declaration),
            ))
            .await;
        answers.push(("POST /v1/incidents", a));
    }
    let a = api
        .raw(twice(
            Method::GET,
            "/v1/organizations",
            [ADMIN, ADMIN],
            Body::empty(),
        ))
        .await;
    answers.push(("GET /v1/organizations", a));
    let wrong: Vec<String> = answers
        .iter()
        .filter(|(_, a)| (a.status, a.code()) != (StatusCode::UNAUTHORIZED, "unauthorized"))
        .map(|(what, a)| format!("{what}: {} {}", a.status, a.body))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.incidents").await,
        0
    );
}

#[tokio::test]
async fn a_key_never_reaches_another_organizations_data() {
    let api = setup().await;
    let (_, a_key) = api.organization("a").await;
    let (b_org, b_key) = api.organization("b").await;

    let entity = api
        .post(
            "/v1/entities",
            &a_key,
            json!({"external_id": "db-1", "attributes": {"cpu": 1}}),
        )
        .await
        .body;
    let policy = api
        .post(
            "/v1/policies",
            &a_key,
            json!({"name": "cpu", "singleton": "always",
                   "rule": {"attribute": "cpu", "op": "gt", "value": 90}}),
        )
        .await
        .body;
    let incident = api.declare(&a_key, "a's incident").await;
    let (e, p, i) = (id(&entity), id(&policy), id(&incident));

    // Every read of A's ids with B's key: 404, like an id that does not exist.
    for uri in [
        format!("/v1/entities/{e}"),
        format!("/v1/policies/{p}"),
        format!("/v1/incidents/{i}"),
        format!("/v1/incidents/{i}/timeline"),
    ] {
        let a = api.get(&uri, &b_key).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::NOT_FOUND, "not_found"),
            "{uri}"
        );
        assert!(!a.body.to_string().contains("a's incident"));
    }
    // Every write: 404, and A's rows are unchanged.
    for uri in [
        format!("/v1/incidents/{i}/acknowledge"),
        format!("/v1/incidents/{i}/resolve"),
    ] {
        let a = api.post(&uri, &b_key, json!({})).await;
        assert_eq!(a.status, StatusCode::NOT_FOUND, "{uri}");
    }
    let a = api
        .put(
            &format!("/v1/entities/{e}/singleton"),
            &b_key,
            json!({"singleton": true}),
        )
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    let a = api.get(&format!("/v1/incidents/{i}"), &a_key).await;
    assert_eq!(a.body["lifecycle"], "OPEN");
    let a = api.get(&format!("/v1/entities/{e}"), &a_key).await;
    assert_eq!(a.body["singleton_incidents"], false);

    // Listings and the feed show only the caller's rows.
    for uri in [
        "/v1/entities",
        "/v1/policies",
        "/v1/incidents",
        "/v1/events",
    ] {
        let a = api.get(uri, &b_key).await;
        assert_eq!(a.status, StatusCode::OK, "{uri}");
        let list = a
            .body
            .as_object()
            .unwrap()
            .values()
            .find_map(Value::as_array)
            .unwrap();
        assert!(list.is_empty(), "{uri}: {}", a.body);
    }
    let a = api
        .get(
            &format!("/v1/incidents?entity_id={e}&policy_id={p}"),
            &b_key,
        )
        .await;
    assert_eq!(a.body["incidents"], json!([]));
    // B's same external id is B's own entity; B's numbers start at 1.
    let b_entity = api
        .post("/v1/entities", &b_key, json!({"external_id": "db-1"}))
        .await
        .body;
    assert_ne!(id(&b_entity), e);
    assert_eq!(b_entity["organization_id"], b_org);
    assert_eq!(api.declare(&b_key, "b's first").await["number"], 1);
}

#[tokio::test]
async fn entities_and_policies_are_created_listed_and_fetched() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    let mut ids = Vec::new();
    for n in 0..5 {
        let a = api
            .post(
                "/v1/entities",
                &key,
                json!({"external_id": format!("host-{n}"), "attributes": {"n": n}}),
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        assert_eq!(a.body["organization_id"], org);
        ids.push(id(&a.body));
    }
    // Upsert: same external id, same entity, new attributes.
    let a = api
        .post(
            "/v1/entities",
            &key,
            json!({"external_id": "host-0", "attributes": {"n": 42}}),
        )
        .await;
    assert_eq!(id(&a.body), ids[0]);
    assert_eq!(a.body["attributes"], json!({"n": 42}));

    // Keyset pages of 2 cover all five, in id order, once each.
    let mut seen = Vec::new();
    let mut after = 0;
    loop {
        let a = api
            .get(&format!("/v1/entities?after={after}&limit=2"), &key)
            .await;
        seen.extend(a.body["entities"].as_array().unwrap().iter().map(id));
        match a.body["next_after"].as_i64() {
            Some(next) => after = next,
            None => break,
        }
    }
    assert_eq!(seen, ids);
    for bad in ["limit=0", "limit=501", "limit=x", "after=abc", "colour=red"] {
        let a = api.get(&format!("/v1/entities?{bad}"), &key).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
            "{bad}"
        );
    }

    let a = api.get(&format!("/v1/entities/{}", ids[1]), &key).await;
    assert_eq!(a.body["external_id"], "host-1");
    let singleton = format!("/v1/entities/{}/singleton", ids[1]);
    let a = api.put(&singleton, &key, json!({"singleton": true})).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body["singleton_incidents"], true);
    let a = api.put(&singleton, &key, json!({"singleton": "yes"})).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        api.get("/v1/entities/987654", &key).await.status,
        StatusCode::NOT_FOUND
    );
    let a = api
        .put(
            "/v1/entities/987654/singleton",
            &key,
            json!({"singleton": true}),
        )
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);

    // Policies.
    let rule = json!({"attribute": "cpu", "op": "gte", "value": 90.5});
    let a = api
        .post(
            "/v1/policies",
            &key,
            json!({"name": "cpu", "singleton": "per_entity", "rule": rule}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let policy = id(&a.body);
    let a = api.get(&format!("/v1/policies/{policy}"), &key).await;
    assert_eq!(a.body["singleton"], "per_entity");
    assert_eq!(a.body["rule"], rule);
    let a = api.get("/v1/policies", &key).await;
    assert_eq!(a.body["policies"].as_array().unwrap().len(), 1);
    let a = api
        .post(
            "/v1/policies",
            &key,
            json!({"name": "cpu", "singleton": "never", "rule": rule}),
        )
        .await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::CONFLICT, "already_exists")
    );
    for bad in [
        json!({"name": "p", "singleton": "sometimes", "rule": rule}),
        json!({"name": "p", "singleton": "never",
               "rule": {"attribute": "cpu", "op": "like", "value": 1}}),
        json!({"name": "p", "singleton": "never",
               "rule": {"attribute": "cpu", "op": "gt", "value": "9"}}),
        json!({"name": "p", "singleton": "never",
               "rule": {"attribute": "", "op": "gt", "value": 9}}),
        json!({"name": "", "singleton": "never", "rule": rule}),
        json!({"name": "p", "singleton": "never"}),
        json!({"name": "p", "singleton": "never", "rule": rule, "extra": 1}),
    ] {
        let a = api.post("/v1/policies", &key, bad.clone()).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
            "{bad}"
        );
    }
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.policies").await,
        1
    );
    assert_eq!(
        api.get("/v1/policies/424242", &key).await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn incidents_move_through_their_lifecycle_and_an_invalid_transition_is_409() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    api.post("/v1/entities", &key, json!({"external_id": "db-1"}))
        .await;
    let a = api
        .post(
            "/v1/incidents",
            &key,
            json!({"title": "db down", "entity": "db-1", "actor": "alice"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert_eq!(a.body["number"], 1);
    assert_eq!(a.body["lifecycle"], "OPEN");
    assert_eq!(a.body["opened_by"], "alice");
    let i = id(&a.body);

    let a = api
        .post(
            &format!("/v1/incidents/{i}/acknowledge"),
            &key,
            json!({"actor": "bob"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body["lifecycle"], "ACKNOWLEDGED");
    assert_eq!(a.body["acknowledged_by"], "bob");
    let a = api
        .post(&format!("/v1/incidents/{i}/acknowledge"), &key, json!({}))
        .await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::CONFLICT, "invalid_transition")
    );
    // An empty body is allowed for actions (the actor defaults).
    let a = api
        .send(
            Method::POST,
            &format!("/v1/incidents/{i}/resolve"),
            Some(&key),
            Body::empty(),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["lifecycle"], "RESOLVED");
    assert_eq!(a.body["resolved_by"], "api");
    for action in ["acknowledge", "resolve"] {
        let a = api
            .post(&format!("/v1/incidents/{i}/{action}"), &key, json!({}))
            .await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::CONFLICT, "invalid_transition"),
            "{action}"
        );
    }
    let a = api
        .post(
            &format!("/v1/incidents/{i}/resolve"),
            &key,
            json!({"actor": "a\u{0}b"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    let a = api
        .post("/v1/incidents/777777/resolve", &key, json!({}))
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);

    // The timeline: each change, in order.
    let a = api.get(&format!("/v1/incidents/{i}/timeline"), &key).await;
    let types: Vec<&str> = a.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        ["IncidentOpened", "IncidentAcknowledged", "IncidentResolved"],
        "{}",
        a.body
    );
    let a = api.get("/v1/incidents/777777/timeline", &key).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);

    // Idempotency: the header or the body field; one key is one incident.
    let once = json!({"title": "once"});
    let first = api
        .post_with_key("/v1/incidents", &key, "k-1", once.clone())
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(first.body["number"], 2);
    let again = api
        .post_with_key("/v1/incidents", &key, "k-1", once.clone())
        .await;
    let by_body = api
        .post(
            "/v1/incidents",
            &key,
            json!({"title": "once", "idempotency_key": "k-1"}),
        )
        .await;
    assert_eq!(id(&again.body), id(&first.body));
    assert_eq!(id(&by_body.body), id(&first.body));
    let a = api
        .post_with_key(
            "/v1/incidents",
            &key,
            "k-2",
            json!({"title": "t", "idempotency_key": "k-3"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.incidents").await,
        2
    );
}

#[tokio::test]
async fn incident_listing_pages_by_number_with_filters() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let web = api
        .post("/v1/entities", &key, json!({"external_id": "web"}))
        .await;
    let e = id(&web.body);
    for n in 1..=7 {
        let body = if n % 2 == 0 {
            json!({"title": format!("i{n}"), "entity": "web"})
        } else {
            json!({"title": format!("i{n}")})
        };
        let a = api.post("/v1/incidents", &key, body).await;
        assert_eq!(a.body["number"], n);
        if n % 3 == 0 {
            let uri = format!("/v1/incidents/{}/resolve", id(&a.body));
            assert_eq!(api.post(&uri, &key, json!({})).await.status, StatusCode::OK);
        }
    }
    let mut seen = Vec::new();
    let mut uri = "/v1/incidents?limit=3".to_owned();
    loop {
        let a = api.get(&uri, &key).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        seen.extend(numbers(&a));
        match a.body["next_before"].as_i64() {
            Some(before) => uri = format!("/v1/incidents?limit=3&before={before}"),
            None => break,
        }
    }
    assert_eq!(seen, [7, 6, 5, 4, 3, 2, 1]);

    let list = async |query: &str| numbers(&api.get(&format!("/v1/incidents?{query}"), &key).await);
    assert_eq!(list("lifecycle=RESOLVED").await, [6, 3]);
    assert_eq!(list("lifecycle=OPEN&before=5").await, [4, 2, 1]);
    assert_eq!(list(&format!("entity_id={e}")).await, [6, 4, 2]);
    assert_eq!(list("policy_id=1").await, Vec::<i64>::new());
    for bad in [
        "limit=0",
        "limit=501",
        "lifecycle=CLOSED",
        "before=x",
        "entity_id=1.5",
    ] {
        let a = api.get(&format!("/v1/incidents?{bad}"), &key).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
            "{bad}"
        );
    }
}

#[tokio::test]
async fn the_event_feed_returns_events_after_a_position_and_long_polls() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let first = api.declare(&key, "one").await;
    let ack = format!("/v1/incidents/{}/acknowledge", id(&first));
    api.post(&ack, &key, json!({})).await;

    let a = api.get("/v1/events?after=0", &key).await;
    let events = a.body["events"].as_array().unwrap().clone();
    assert_eq!(events.len(), 2, "{}", a.body);
    let next = a.body["next"].as_i64().unwrap();
    assert_eq!(next, events[1]["position"].as_i64().unwrap());
    // After the last position: nothing, at once.
    let a = api.get(&format!("/v1/events?after={next}"), &key).await;
    assert_eq!(a.body["events"], json!([]));
    assert_eq!(a.body["next"], next);
    // After the first position: only the second event.
    let p1 = events[0]["position"].as_i64().unwrap();
    let a = api.get(&format!("/v1/events?after={p1}"), &key).await;
    assert_eq!(a.body["events"].as_array().unwrap().len(), 1);
    assert_eq!(a.body["events"][0]["type"], "IncidentAcknowledged");
    let a = api.get("/v1/events?after=0&limit=1", &key).await;
    assert_eq!(a.body["events"].as_array().unwrap().len(), 1);

    // Long poll: a waiting request returns the event declared meanwhile.
    let waiting = {
        let router = api.router.clone();
        let request = Request::get(format!("/v1/events?after={next}&wait=20"))
            .header(header::AUTHORIZATION, format!("Bearer {key}"))
            .body(Body::empty())
            .unwrap();
        tokio::spawn(async move {
            let response = router.oneshot(request).await.unwrap();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            serde_json::from_slice::<Value>(&bytes).unwrap()
        })
    };
    api.declare(&key, "two").await;
    let body = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(body["events"][0]["type"], "IncidentOpened", "{body}");
    assert_eq!(body["events"][0]["data"]["title"], "two");

    for bad in ["after=-1", "after=x", "limit=0", "wait=-3"] {
        let a = api.get(&format!("/v1/events?{bad}"), &key).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
            "{bad}"
        );
    }
}

#[tokio::test]
async fn observations_are_queued_in_the_entitys_group_for_the_callers_organization_only() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    let (other, _) = api.organization("other").await;
    let body = json!({"organization_id": org, "entity": "db-1", "attributes": {"cpu": 95}});
    let a = api.post("/v1/observations", &key, body.clone()).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    let got = api.queue.receive(ReceiveRequest::default()).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].group_id.as_deref(),
        Some(format!("{org}/db-1").as_str())
    );
    assert_eq!(serde_json::from_str::<Value>(&got[0].body).unwrap(), body);
    assert_eq!(got[0].id, a.body["message_id"].as_str().unwrap());

    // Another organization's id, or bad observations: refused, nothing queued.
    let a = api
        .post(
            "/v1/observations",
            &key,
            json!({"organization_id": other, "entity": "db-1", "attributes": {}}),
        )
        .await;
    assert_eq!((a.status, a.code()), (StatusCode::NOT_FOUND, "not_found"));
    for bad in [
        json!({"organization_id": org, "entity": "", "attributes": {}}),
        json!({"organization_id": org, "entity": "a\u{0}", "attributes": {}}),
        json!({"organization_id": org, "entity": "a", "attributes": [1]}),
        // jsonb refuses \u0000: refused at the door, not queued to fail on
        // every delivery until it is dead-lettered.
        json!({"organization_id": org, "entity": "a", "attributes": {"k": "v\u{0}"}}),
        json!({"organization_id": org, "entity": "a", "attributes": {}, "extra": true}),
        json!({"organization_id": org, "entity": "a", "attributes": {}, "message_id": ""}),
        json!({"organization_id": "1", "entity": "a", "attributes": {}}),
        json!({"entity": "a", "attributes": {}}),
    ] {
        let a = api.post("/v1/observations", &key, bad.clone()).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
            "{bad}"
        );
    }
    assert_eq!(api.queue.stats().await.unwrap().depth, 0);

    // An Idempotency-Key deduplicates a resend.
    for duplicate in [false, true] {
        let a = api
            .post_with_key("/v1/observations", &key, "obs-1", body.clone())
            .await;
        assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
        assert_eq!(a.body["duplicate"], duplicate);
    }
    assert_eq!(api.queue.stats().await.unwrap().depth, 1);

    // The same key from another organization is that organization's own:
    // queued, not taken for acme's resend. A key too long for a queue's
    // deduplication id is accepted too.
    let (globex, other_key) = api.organization("globex").await;
    let theirs = json!({"organization_id": globex, "entity": "db-1", "attributes": {"cpu": 95}});
    for key in ["obs-1", &"k".repeat(300)] {
        let a = api
            .post_with_key("/v1/observations", &other_key, key, theirs.clone())
            .await;
        assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
        assert_eq!(a.body["duplicate"], false, "{key}");
    }
    assert_eq!(api.queue.stats().await.unwrap().depth, 3);

    // The producer's own message id, without the header, deduplicates too.
    let with_id = json!({"organization_id": org, "entity": "db-2", "attributes": {}, "message_id": "sensor-7/1"});
    for duplicate in [false, true] {
        let a = api.post("/v1/observations", &key, with_id.clone()).await;
        assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
        assert_eq!(a.body["duplicate"], duplicate);
    }
    assert_eq!(api.queue.stats().await.unwrap().depth, 4);
}

#[tokio::test]
async fn malformed_and_hostile_input_gets_json_errors_and_writes_nothing() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let incidents = "SELECT count(*) FROM incidents.incidents";
    // Not JSON: 400 malformed_json, as JSON. A broken escape, and text
    // that is not UTF-8, included.
    for body in [
        &b"{"[..],
        b"not json",
        b"",
        b"{\"title\": \"x\",}",
        b"\0",
        br#"{"title": "\u12"}"#,
        br#"{"title": "\uZZZZ"}"#,
        b"{\"title\": \"\xff\"}",
    ] {
        let a = api
            .send(Method::POST, "/v1/incidents", Some(&key), Body::from(body))
            .await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::BAD_REQUEST, "malformed_json"),
            "{:?}",
            String::from_utf8_lossy(body)
        );
        assert!(a.content_type.starts_with("application/json"));
    }
    // JSON of the wrong shape: 422.
    for body in [
        "[]",
        "1",
        "{}",
        "{\"title\": 5}",
        "{\"title\": \"x\", \"nope\": 1}",
        "{\"title\": null}",
    ] {
        let a = api
            .send(Method::POST, "/v1/incidents", Some(&key), Body::from(body))
            .await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
            "{body}"
        );
    }
    // Hostile strings: NUL, 10 KB names, blank titles.
    let long = "x".repeat(10 * 1024);
    for body in [
        json!({"title": "a\u{0}b"}),
        json!({"title": long}),
        json!({"title": "   "}),
        json!({"title": "t", "entity": long}),
        json!({"title": "t", "idempotency_key": "k\u{0}"}),
        json!({"title": "t", "actor": long}),
    ] {
        let a = api.post("/v1/incidents", &key, body).await;
        assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.body);
    }
    for body in [
        json!({"external_id": long}),
        json!({"external_id": "a\u{0}"}),
        json!({"external_id": "a", "attributes": "x"}),
        // jsonb refuses \u0000: refused as input, not a 500.
        json!({"external_id": "a", "attributes": {"k": "v\u{0}"}}),
        json!({"external_id": "a", "attributes": {"k\u{0}": 1}}),
        json!({"external_id": "a", "attributes": {"k": [{"deep": "\u{0}"}]}}),
    ] {
        let a = api.post("/v1/entities", &key, body).await;
        assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.body);
    }
    // A misspelt filter is refused, not ignored (which would list everything).
    let a = api.get("/v1/incidents?lifecyle=OPEN", &key).await;
    assert!(a.status.is_client_error(), "{}", a.status);
    assert_eq!(a.code(), "invalid", "{}", a.body);
    for (uri, body) in [
        ("/v1/organizations", json!({"name": long})),
        ("/v1/organizations", json!({"name": "a\u{0}"})),
        ("/v1/organizations/1/keys", json!({"name": "k\u{0}"})),
    ] {
        let a = api.post(uri, ADMIN, body).await;
        assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.body);
    }
    assert_eq!(api.count(incidents).await, 0);
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.entities").await,
        0
    );
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.organizations")
            .await,
        1
    );
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.api_keys").await,
        1
    );

    // SQL-ish and odd text is stored and returned verbatim.
    let sqlish = "'); DROP TABLE incidents.incidents; -- \u{1F525} ünïcode \"q\" \\ %";
    let entity = "Robert'); DROP TABLE incidents.entities;--";
    api.post("/v1/entities", &key, json!({"external_id": entity}))
        .await;
    let a = api
        .post(
            "/v1/incidents",
            &key,
            json!({"title": sqlish, "entity": entity}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let got = api
        .get(&format!("/v1/incidents/{}", id(&a.body)), &key)
        .await;
    assert_eq!(got.body["title"], sqlish);
    assert_eq!(api.count(incidents).await, 1);

    // An oversized body: 413 as JSON, nothing written.
    let huge = json!({"title": "x".repeat(100 * 1024)}).to_string();
    let a = api
        .send(Method::POST, "/v1/incidents", Some(&key), Body::from(huge))
        .await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large")
    );
    assert_eq!(api.count(incidents).await, 1);

    // Bad ids, unknown routes and methods: JSON too.
    for uri in [
        "/v1/incidents/abc",
        "/v1/incidents/1.5",
        "/v1/entities/99999999999999999999",
    ] {
        let a = api.get(uri, &key).await;
        assert_eq!(
            (a.status, a.code()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
            "{uri}"
        );
    }
    let a = api.get("/v1/incidents/9223372036854775807", &key).await;
    assert_eq!((a.status, a.code()), (StatusCode::NOT_FOUND, "not_found"));
    let a = api.get("/v1/nothing-here", &key).await;
    assert_eq!((a.status, a.code()), (StatusCode::NOT_FOUND, "no_route"));
    let a = api.delete("/v1/incidents", &key).await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
    );
}

#[tokio::test]
async fn health_readiness_metrics_and_the_openapi_document() {
    let api = setup().await;
    assert_eq!(api.get("/healthz", "").await.body, json!({"status": "ok"}));
    assert_eq!(api.get("/readyz", "").await.status, StatusCode::OK);
    let a = api.get("/metrics", "").await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(
        a.content_type.starts_with("text/plain"),
        "{}",
        a.content_type
    );

    // Every documented route is in the router (not the fallback, not 405).
    let doc = api.get("/openapi.json", "").await.body;
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    let operations: usize = paths.values().map(|p| p.as_object().unwrap().len()).sum();
    assert_eq!(operations, openapi::ROUTES.len());
    // The two routes that read an Idempotency-Key header document it, so
    // that a client generated from the document can send it (and the
    // fuzz test sends it).
    for (path, max_length) in [
        ("/v1/incidents", json!(200)),
        ("/v1/observations", json!(null)),
    ] {
        let header = paths[path]["post"]["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["in"] == "header")
            .unwrap_or_else(|| panic!("POST {path} documents no header"))
            .clone();
        assert_eq!(header["name"], "Idempotency-Key", "{header}");
        assert_eq!(header["required"], false, "{header}");
        assert_eq!(header["schema"]["minLength"], 1, "{header}");
        assert_eq!(header["schema"]["maxLength"], max_length, "{header}");
    }
    for route in openapi::ROUTES {
        let method = route.method.to_ascii_lowercase();
        assert!(
            paths[route.path].get(&method).is_some(),
            "{method} {}",
            route.path
        );
        let uri = route
            .path
            .replace("{org_id}", "1")
            .replace("{id}", "1")
            .replace("{prefix}", "abc");
        let method = Method::from_bytes(route.method.as_bytes()).unwrap();
        let a = api
            .send(method.clone(), &uri, Some("x"), Body::from("{}"))
            .await;
        assert_ne!(a.code(), "no_route", "{} {}", route.method, route.path);
        // Every route that needs credentials refuses none and wrong ones,
        // before it looks at the body or the ids.
        if route.auth != openapi::Auth::None {
            for token in [None, Some("x"), Some("pgo_abc_def")] {
                let a = api
                    .send(method.clone(), &uri, token, Body::from("{}"))
                    .await;
                assert_eq!(
                    (a.status, a.code()),
                    (StatusCode::UNAUTHORIZED, "unauthorized"),
                    "{} {} with {token:?}",
                    route.method,
                    route.path
                );
            }
        }
        assert_ne!(
            a.status,
            StatusCode::METHOD_NOT_ALLOWED,
            "{} {}",
            route.method,
            route.path
        );
    }

    // Not ready when the database does not answer; still alive. A request
    // that needs the database is a 503 too, not an internal error, and
    // says nothing of sqlx's error (`... on a closed pool`).
    let (_, key) = api.organization("acme").await;
    api.pool.close().await;
    let a = api.get("/readyz", "").await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
    );
    assert_eq!(api.get("/healthz", "").await.status, StatusCode::OK);
    let a = api.get("/v1/incidents", &key).await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        "{}",
        a.body
    );
    let message = a.body["error"]["message"].as_str().unwrap();
    assert!(!message.contains("pool"), "{message}");
}

/// Every JSON answer of the API has the shape its OpenAPI schema states:
/// the required properties, no undocumented ones, and request bodies taken
/// from the document accepted. Checked over real calls to every route that
/// answers JSON, so the document cannot drift from the handlers unnoticed.
#[tokio::test]
#[rustfmt::skip]
async fn answers_have_the_shapes_the_openapi_document_states() {
    let api = setup().await;
    let doc = api.get("/openapi.json", "").await.body;
    let created = api
        .post("/v1/organizations", ADMIN, json!({ "name": "acme" }))
        .await;
    let key = created.body["api_key"].as_str().unwrap().to_owned();
    let org = created.body["organization"]["id"].as_i64().unwrap();
    let mut answers = vec![("POST", "/v1/organizations", created)];
    let call = async |method: &'static str, path: &'static str, uri: String, body: Value| {
        let auth = if path.starts_with("/v1/organizations") || path == "/v1/settings" {
            ADMIN
        } else {
            key.as_str()
        };
        let a = match method {
            "GET" => api.get(&uri, auth).await,
            "PUT" => api.put(&uri, auth, body).await,
            _ => api.post(&uri, auth, body).await,
        };
        assert!(a.status.is_success(), "{method} {uri}: {}", a.body);
        (method, path, a)
    };
    let rule = json!({"attribute": "cpu", "op": "gt", "value": 90.0});
    let setup_calls = [
        ("GET", "/v1/organizations", "/v1/organizations".to_owned(), Value::Null),
        ("POST", "/v1/organizations/{org_id}/keys", format!("/v1/organizations/{org}/keys"), json!({"name": "ci"})),
        ("GET", "/v1/settings", "/v1/settings".into(), Value::Null),
        ("PUT", "/v1/settings", "/v1/settings".into(), json!({"rollout_percent": 100})),
        ("POST", "/v1/entities", "/v1/entities".into(), json!({"external_id": "db-1", "attributes": {"cpu": 1}})),
        ("GET", "/v1/entities", "/v1/entities?limit=10".into(), Value::Null),
        ("POST", "/v1/policies", "/v1/policies".into(), json!({"name": "cpu", "singleton": "always", "rule": rule})),
        ("GET", "/v1/policies", "/v1/policies".into(), Value::Null),
        ("POST", "/v1/incidents", "/v1/incidents".into(), json!({"title": "db down", "entity": "db-1"})),
        ("GET", "/v1/incidents", "/v1/incidents?lifecycle=OPEN&limit=5".into(), Value::Null),
        ("POST", "/v1/observations", "/v1/observations".into(), json!({"organization_id": org, "entity": "db-1", "attributes": {}})),
        ("GET", "/v1/events", "/v1/events?after=0".into(), Value::Null),
        ("GET", "/healthz", "/healthz".into(), Value::Null),
        ("GET", "/readyz", "/readyz".into(), Value::Null),
    ];
    for (method, path, uri, body) in setup_calls {
        answers.push(call(method, path, uri, body).await);
    }
    let first = |path: &str, list: &str| {
        let (_, _, a) = answers.iter().find(|(m, p, _)| *m == "GET" && *p == path).unwrap();
        a.body[list][0]["id"].as_i64().unwrap()
    };
    let (e, p, i) = (
        first("/v1/entities", "entities"),
        first("/v1/policies", "policies"),
        first("/v1/incidents", "incidents"),
    );
    let by_id = [
        ("GET", "/v1/entities/{id}", format!("/v1/entities/{e}"), Value::Null),
        ("PUT", "/v1/entities/{id}/singleton", format!("/v1/entities/{e}/singleton"), json!({"singleton": true})),
        ("GET", "/v1/policies/{id}", format!("/v1/policies/{p}"), Value::Null),
        ("GET", "/v1/incidents/{id}", format!("/v1/incidents/{i}"), Value::Null),
        ("POST", "/v1/incidents/{id}/acknowledge", format!("/v1/incidents/{i}/acknowledge"), json!({"actor": "alice"})),
        ("POST", "/v1/incidents/{id}/resolve", format!("/v1/incidents/{i}/resolve"), json!({})),
        ("GET", "/v1/incidents/{id}/timeline", format!("/v1/incidents/{i}/timeline"), Value::Null),
    ];
    for (method, path, uri, body) in by_id {
        answers.push(call(method, path, uri, body).await);
    }

    for (method, path, answer) in &answers {
        let operation = &doc["paths"][path][method.to_ascii_lowercase()];
        let schema = &operation["responses"][answer.status.as_str()]["content"]["application/json"]
            ["schema"];
        assert!(
            schema.is_object(),
            "{method} {path}: no schema for {}",
            answer.status
        );
        conforms(&doc, schema, &answer.body, &format!("{method} {path}"));
    }
    let checked: BTreeSet<(&str, &str)> = answers.iter().map(|(m, p, _)| (*m, *p)).collect();
    for route in openapi::ROUTES.iter().filter(|r| r.response.is_some()) {
        assert!(
            checked.contains(&(route.method, route.path)) || route.path == "/openapi.json",
            "{} {} has a documented response no call checked",
            route.method,
            route.path
        );
    }
}

/// `value` has what `schema` requires and nothing it does not list, down
/// through objects and arrays; `$ref`s resolve in the document's
/// components.
fn conforms(doc: &Value, schema: &Value, value: &Value, at: &str) {
    let schema = match schema["$ref"].as_str() {
        Some(r) => {
            let name = r.strip_prefix("#/components/schemas/").unwrap();
            &doc["components"]["schemas"][name]
        }
        None => schema,
    };
    assert!(schema.is_object(), "{at}: unresolved schema");
    if let Some(props) = schema["properties"].as_object() {
        let object = value
            .as_object()
            .unwrap_or_else(|| panic!("{at}: not an object: {value}"));
        for required in schema["required"].as_array().into_iter().flatten() {
            let name = required.as_str().unwrap();
            assert!(object.contains_key(name), "{at}: missing {name} in {value}");
        }
        for (name, v) in object {
            let p = props
                .get(name)
                .unwrap_or_else(|| panic!("{at}: {name} is not documented"));
            conforms(doc, p, v, &format!("{at}.{name}"));
        }
    }
    if let (Some(items), Some(values)) = (schema.get("items"), value.as_array()) {
        for v in values {
            conforms(doc, items, v, &format!("{at}[]"));
        }
    }
}

/// `a` is a 422 `invalid`.
fn assert_invalid(a: &Answer, context: impl std::fmt::Display) {
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
        "{context}: {}",
        a.body
    );
}

/// The largest finite double, as a rule value and as an attribute, is
/// accepted and reads back equal through the API, and the organization's
/// listings keep working (a value stored but not read back would fail
/// every later read).
#[tokio::test]
async fn extreme_doubles_read_back_equal_and_poison_nothing() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let huge: Value = serde_json::from_str("1.7976931348623157e308").unwrap();
    api.assert_rule_value_reads_back(&key, &huge).await;
    let attributes = json!({"x": huge, "tiny": 5e-324, "neg": -f64::MAX, "n": [1.5, -0.25]});
    api.assert_attributes_read_back(&key, &attributes).await;
}

/// A rule value past 2^53 whose shortest decimal has fewer digits than its
/// integer part (`1.844674407370955e19`, exactly 18446744073709549568) is
/// stored by `jsonb` as that decimal, `18446744073709550000`, which reads
/// back as an integer: the policy must still read back equal, and the
/// organization's listing keep working (the pipeline reads its policies
/// the same way, for every observation).
#[tokio::test]
async fn rule_values_the_database_prints_as_integers_read_back_equal() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    for (i, text) in [
        "1.844674407370955e19",
        "-9.223372036854775e18",
        "1.2345678901234566e17",
    ]
    .into_iter()
    .enumerate()
    {
        let value: Value = serde_json::from_str(text).unwrap();
        let rule = json!({"attribute": "x", "op": "gt", "value": value});
        let body = json!({"name": format!("p{i}"), "singleton": "never", "rule": rule});
        let a = api.post("/v1/policies", &key, body).await;
        assert_eq!(a.status, StatusCode::CREATED, "{text}: {}", a.body);
        let a = api
            .get(&format!("/v1/policies/{}", id(&a.body)), &key)
            .await;
        assert_eq!(a.status, StatusCode::OK, "{text}: {}", a.body);
        assert_eq!(a.body["rule"]["value"], value, "{text}");
    }
    let a = api.get("/v1/policies", &key).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["policies"].as_array().unwrap().len(), 3);
}

/// `POST /v1/entities` without `attributes` creates the entity with none
/// (`{}`) and leaves an existing one's as they are: they are its latest
/// observation's, which a client registering the entity (to flag it for
/// singleton incidents, say) had no mind to erase. Before, they were
/// replaced by `{}`. Sent, `attributes` replace the entity's, `{}` too;
/// `null` is not an object (422), and changes nothing.
#[tokio::test]
async fn an_entity_posted_without_attributes_keeps_its_attributes() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let created = api
        .post("/v1/entities", &key, json!({"external_id": "db-2"}))
        .await;
    assert_eq!(created.status, StatusCode::OK, "{}", created.body);
    assert_eq!(created.body["attributes"], json!({}));
    let sent = json!({"cpu": 3, "disk": [1.5, "sda"]});
    let first = api
        .post(
            "/v1/entities",
            &key,
            json!({"external_id": "db-1", "attributes": sent}),
        )
        .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    let entity = format!("/v1/entities/{}", id(&first.body));
    // Each body posted in turn, with the status answered and the
    // attributes read back after it.
    for (body, status, read_back) in [
        (json!({"external_id": "db-1"}), StatusCode::OK, &sent),
        (
            json!({"external_id": "db-1", "attributes": null}),
            StatusCode::UNPROCESSABLE_ENTITY,
            &sent,
        ),
        (
            json!({"external_id": "db-1", "attributes": {}}),
            StatusCode::OK,
            &json!({}),
        ),
    ] {
        let a = api.post("/v1/entities", &key, body.clone()).await;
        assert_eq!(a.status, status, "{body}: {}", a.body);
        if a.status == StatusCode::OK {
            assert_eq!(a.body["attributes"], *read_back, "{body}: answered");
        }
        let fetched = api.get(&entity, &key).await;
        assert_eq!(fetched.body["attributes"], *read_back, "{body}: read back");
    }
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.entities").await,
        2
    );
}

/// A negative zero (`-0.0`, `-0`, `-0e5`) is zero: `jsonb` keeps numbers
/// as `numeric`, which has no sign for zero, so it reads back as `0.0`. A
/// rule value of `-0.0` was answered `-0.0` by `POST /v1/policies`, which
/// echoed the rule it was sent, and listed as `0.0` afterwards. Now the
/// answer is the rule as stored, `0.0`, as the listing and `GET` read it
/// back (a rule compares with `-0.0` as with `0.0`: nothing else changes).
/// An entity's attributes answer and read back `0.0` too, checked here
/// against the database's own text; an observation's are taken (202) and
/// queued as parsed, `-0.0`, then recorded as `0.0` by the pipeline (see
/// `pipeline.rs` `a_negative_zero_goes_through_the_pipeline_as_zero`).
#[tokio::test]
async fn a_negative_zero_is_answered_as_it_reads_back() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    let text = |v: &Value| v.to_string();
    for (name, value) in [("a", "-0.0"), ("b", "-0"), ("c", "-0e5")] {
        let policy = format!(
            r#"{{"name": "{name}", "singleton": "never", "rule": {{"attribute": "x", "op": "gt", "value": {value}}}}}"#
        );
        let created = api
            .send(Method::POST, "/v1/policies", Some(&key), Body::from(policy))
            .await;
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
        let fetched = api
            .get(&format!("/v1/policies/{}", id(&created.body)), &key)
            .await;
        assert_eq!(fetched.status, StatusCode::OK, "{}", fetched.body);
        assert_eq!(
            text(&created.body["rule"]["value"]),
            text(&fetched.body["rule"]["value"]),
            "{value}: answered as created, then read back"
        );
        assert_eq!(text(&fetched.body["rule"]["value"]), "0.0", "{value}");
    }
    let attributes = r#"{"x": -0.0, "y": [-0, -0e5], "z": {"w": -0.0}}"#;
    let read_back = r#"{"x":0.0,"y":[0.0,0.0],"z":{"w":0.0}}"#;
    let answers = api.send_attributes(org, &key, attributes).await;
    assert_eq!(answers[0].1.status, StatusCode::OK, "{}", answers[0].1.body);
    assert_eq!(text(&answers[0].1.body["attributes"]), read_back);
    assert_eq!(
        answers[1].1.status,
        StatusCode::ACCEPTED,
        "{}",
        answers[1].1.body
    );
    let listed = api.get("/v1/entities", &key).await;
    assert_eq!(text(&listed.body["entities"][0]["attributes"]), read_back);
    let stored: String = sqlx::query_scalar("SELECT attributes::text FROM incidents.entities")
        .fetch_one(&api.pool)
        .await
        .unwrap();
    assert_eq!(stored, r#"{"x": 0.0, "y": [0.0, 0.0], "z": {"w": 0.0}}"#);
}

/// A double that is a whole number past 10^16 (where serde_json writes an
/// exponent, `1e16`, and `jsonb` keeps the plain digits) reads back as the
/// same double, not as an integer: in attributes, at any depth, through
/// the entity's answer and its listing, and as a rule value.
#[tokio::test]
async fn whole_doubles_read_back_as_doubles() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let attributes = json!({
        "a": 1e16,
        "b": -9.2e18,
        "c": 1.8e19,
        "d": [1e17, -1e16],
        "e": {"f": 1.2345678901234568e17},
        "g": 1e300,
        "h": 100.0,
        "i": 100,
    });
    api.assert_attributes_read_back(&key, &attributes).await;
    api.assert_rule_value_reads_back(&key, &json!(1e16)).await;
}

/// A number is kept as sent or refused. serde_json parses an integer past
/// the 64-bit ranges, or a decimal with more digits than a double holds,
/// into the nearest double, which would be stored and read back changed
/// (`18446744073709551617` as `1.8446744073709552e19`, `1e-400` as `0`),
/// and refuses one past a double's range (`1e400`), which is still valid
/// JSON: such bodies are 422 with nothing written, in attributes and in a
/// rule.
/// At the edges of what is exact, numbers read back as the same numbers.
#[tokio::test]
async fn numbers_that_would_not_read_back_as_sent_are_refused() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let entity = |n: &str| format!(r#"{{"external_id": "e", "attributes": {{"x": {n}}}}}"#);
    for n in [
        "18446744073709551616",
        "18446744073709551617",
        "-9223372036854775809",
        "123456789012345678901234567890",
        "0.10000000000000000001",
        "1e-400",
        "[1, 2.00000000000000000000001]",
        "[[[[[[[[[[[[[[[[[[[[{\"y\": 1e-400}]]]]]]]]]]]]]]]]]]]]",
        // Valid JSON, but past a double's range: it cannot be kept either.
        "1e400",
        "-1e400",
        "[0, 1.5e309]",
    ] {
        let a = api
            .send(
                Method::POST,
                "/v1/entities",
                Some(&key),
                Body::from(entity(n)),
            )
            .await;
        assert_invalid(&a, n);
    }
    // A rule's value is a double: an integer past 2^53 would become its
    // neighbour, though it fits an i64.
    for value in [
        "1e-400",
        "1e400",
        "9007199254740993",
        "18446744073709551615",
    ] {
        let policy = format!(
            r#"{{"name": "p", "singleton": "never", "rule": {{"attribute": "x", "op": "gt", "value": {value}}}}}"#
        );
        let a = api
            .send(Method::POST, "/v1/policies", Some(&key), Body::from(policy))
            .await;
        assert_invalid(&a, value);
    }
    assert_eq!(
        api.count("SELECT (SELECT count(*) FROM incidents.entities) + (SELECT count(*) FROM incidents.policies)")
            .await,
        0
    );
    for (n, back) in [
        ("18446744073709551615", json!(u64::MAX)),
        ("-9223372036854775808", json!(i64::MIN)),
        ("0.1", json!(0.1)),
        ("1E2", json!(100.0)),
        ("-0", json!(0.0)),
        ("0.000", json!(0.0)),
        ("5e-324", json!(5e-324)),
        ("12.5e-1", json!(1.25)),
        ("0e99999999999999999999", json!(0.0)),
    ] {
        let a = api
            .send(
                Method::POST,
                "/v1/entities",
                Some(&key),
                Body::from(entity(n)),
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{n}: {}", a.body);
        assert_eq!(a.body["attributes"]["x"], back, "{n}");
    }
}

/// An entity body of exactly `size` bytes whose attributes hold `number`
/// as many times as fit (`{"x": [number, number, ...]}`), and how many.
fn entity_body_full_of(number: &str, size: usize) -> (String, usize) {
    let head = r#"{"external_id": "e", "attributes": {"x": ["#;
    let tail = "]}}";
    let room = size - head.len() - tail.len();
    let count = (room + 1) / (number.len() + 1);
    let numbers = vec![number; count].join(",");
    let padding = " ".repeat(room - numbers.len());
    let body = format!("{head}{numbers}{padding}{tail}");
    assert_eq!(body.len(), size);
    (body, count)
}

/// The largest body the limit allows, full of the numbers whose check
/// cost most (`1e308` and `5e-324`, which `jsonb` prints as 309 and 326
/// characters), is answered as any body is: refused, as it would print
/// past the attributes' bound
/// (`attributes_that_would_read_back_far_larger_than_sent_are_refused`),
/// while as many as print within it are stored and read back equal.
/// Full of numbers that cannot be kept (an integer past 64 bits, a
/// decimal with more digits than a double holds), it is refused with a
/// 422 that names the number, and nothing is stored. A byte more is 413.
#[tokio::test]
async fn a_body_at_the_limit_full_of_the_costliest_numbers_is_answered() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let limit = ApiConfig::default().body_limit;
    let post = |body: String| api.send(Method::POST, "/v1/entities", Some(&key), Body::from(body));
    for number in [
        "123456789012345678901234567890",
        "0.1000000000000000055511151231257827",
    ] {
        let (body, _) = entity_body_full_of(number, limit);
        let a = post(body).await;
        assert_invalid(&a, number);
        let message = a.body["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("the number {number} cannot be kept exactly")),
            "{message}"
        );
    }
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.entities").await,
        0
    );
    for (number, value) in [("1e308", 1e308), ("5e-324", 5e-324)] {
        let (body, _) = entity_body_full_of(number, limit);
        assert_invalid(&post(body).await, number);
        // About 170 of them, which print in 56 KiB.
        let (body, count) = entity_body_full_of(number, 1200);
        let a = post(body).await;
        assert_eq!(a.status, StatusCode::OK, "{number}: {}", a.body);
        let expected = json!({"x": vec![value; count]});
        assert_eq!(a.body["attributes"], expected, "{number}");
        let a = api.get("/v1/entities", &key).await;
        assert_eq!(a.status, StatusCode::OK, "{number}: {}", a.body);
        assert_eq!(a.body["entities"][0]["attributes"], expected, "{number}");
    }
    let (body, _) = entity_body_full_of("1e308", limit + 1);
    let a = post(body).await;
    assert_eq!(
        (a.status, a.code()),
        (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large")
    );
}

/// Attributes that PostgreSQL would print far longer than they were sent
/// are refused. `jsonb` keeps a number as a `numeric`, stored in a few
/// bytes, and prints it in full, without an exponent: `1e308` as 309
/// digits, `5e-324` as 326 characters. A body at the default limit full of
/// them was stored, and every read of the entity (its answer, the entity
/// listing) then received over 50 times the body from the database and
/// parsed each long number. Now, as an entity and as an observation, such
/// attributes are 422, naming the bound, with nothing stored or queued.
#[tokio::test]
async fn attributes_that_would_read_back_far_larger_than_sent_are_refused() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    let limit = ApiConfig::default().body_limit;
    for number in ["1e308", "5e-324", "-1e300"] {
        let (body, _) = entity_body_full_of(number, limit);
        let a = api
            .send(Method::POST, "/v1/entities", Some(&key), Body::from(body))
            .await;
        let printed = api
            .count(
                "SELECT coalesce(max(octet_length(attributes::text)), 0)::bigint FROM incidents.entities",
            )
            .await;
        assert!(
            printed <= 2 * limit as i64,
            "a {limit}-byte body full of {number} reads back from the database as {printed} bytes"
        );
        assert_invalid(&a, number);
        let message = a.body["error"]["message"].as_str().unwrap();
        assert!(message.contains("as PostgreSQL prints them"), "{message}");
        let head = r#"{"x": ["#;
        let attributes = format!(
            "{head}{}]}}",
            vec![number; limit / (number.len() + 1) - 20].join(",")
        );
        for (uri, a) in api.send_attributes(org, &key, &attributes).await {
            assert_invalid(&a, format!("{uri} {number}"));
        }
    }
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.entities").await,
        0
    );
    assert_eq!(api.queue.stats().await.unwrap().depth, 0, "nothing queued");
}

/// Large attributes that print about as long as they were sent are taken
/// past [`PRINTED_ATTRIBUTES_ALLOWANCE`]: a 1 MiB body (the limit raised
/// to it) of short strings, or of doubles that print in fewer than twice
/// their characters (`1.5e-7` as `0.00000015`), is stored and reads back
/// equal, while one of `1e-7`, printed as `0.0000001`, more than twice
/// as long with its separator, is refused.
#[tokio::test]
async fn large_attributes_that_print_about_as_sent_are_taken() {
    let config = ApiConfig {
        admin_token: Some(ADMIN.into()),
        body_limit: 1 << 20,
        ..ApiConfig::default()
    };
    let api = api_with(config, false).await;
    let (_, key) = api.organization("acme").await;
    for (number, value) in [(r#""abcdef""#, json!("abcdef")), ("1.5e-7", json!(1.5e-7))] {
        let (body, count) = entity_body_full_of(number, 1 << 20);
        let a = api
            .send(Method::POST, "/v1/entities", Some(&key), Body::from(body))
            .await;
        assert_eq!(a.status, StatusCode::OK, "{number}: {}", a.body["error"]);
        let expected = json!({"x": vec![value; count]});
        assert_eq!(a.body["attributes"], expected, "{number}");
        let printed = api
            .count("SELECT octet_length(attributes::text)::bigint FROM incidents.entities")
            .await;
        assert!(
            printed > PRINTED_ATTRIBUTES_ALLOWANCE as i64,
            "{number}: {printed}"
        );
    }
    let (body, _) = entity_body_full_of("1e-7", 1 << 20);
    let a = api
        .send(Method::POST, "/v1/entities", Some(&key), Body::from(body))
        .await;
    assert_invalid(&a, "1e-7");
}

/// Policies and organizations are listed a page at a time, by id, as
/// entities are: `after` (an id, default 0) and `limit` (1 to 500,
/// default 100); `next_after` is the page's last id when the page is
/// full, else null. Keyset pages of 2 cover every row once, in id order;
/// a cursor at or past the last id is an empty last page; a limit of 0 or
/// past 500, or a cursor that is negative or not an integer, is 422.
#[tokio::test]
async fn policies_and_organizations_are_listed_a_page_at_a_time() {
    let api = setup().await;
    let mut organizations = Vec::new();
    let mut key = String::new();
    for name in ["a", "b", "c", "d", "e"] {
        let (org, org_key) = api.organization(name).await;
        organizations.push(org);
        key = org_key;
    }
    let mut policies = Vec::new();
    for i in 0..5 {
        let rule = json!({"attribute": "x", "op": "gt", "value": i});
        let body = json!({"name": format!("p{i}"), "singleton": "never", "rule": rule});
        let a = api.post("/v1/policies", &key, body).await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        policies.push(id(&a.body));
    }
    for (path, list, auth, ids) in [
        ("/v1/policies", "policies", key.as_str(), &policies),
        ("/v1/organizations", "organizations", ADMIN, &organizations),
    ] {
        let mut seen = Vec::new();
        let mut after = 0;
        loop {
            let a = api
                .get(&format!("{path}?after={after}&limit=2"), auth)
                .await;
            assert_eq!(a.status, StatusCode::OK, "{path}: {}", a.body);
            let page = a.body[list].as_array().unwrap();
            assert!(page.len() <= 2, "{path}: {}", a.body);
            seen.extend(page.iter().map(id));
            match a.body["next_after"].as_i64() {
                Some(next) => after = next,
                None => break,
            }
        }
        assert_eq!(seen, *ids, "{path}");
        let whole = api.get(path, auth).await;
        assert_eq!(whole.body[list].as_array().unwrap().len(), ids.len());
        assert_eq!(whole.body["next_after"], Value::Null, "{path}");
        let last = ids.last().unwrap();
        for past in [*last, last + 1000] {
            let a = api.get(&format!("{path}?after={past}"), auth).await;
            assert_eq!(a.status, StatusCode::OK, "{path}: {}", a.body);
            assert_eq!(a.body[list], json!([]), "{path}?after={past}");
            assert_eq!(a.body["next_after"], Value::Null, "{path}?after={past}");
        }
        for bad in [
            "limit=0",
            "limit=501",
            "limit=x",
            "after=-1",
            "after=abc",
            "colour=red",
        ] {
            let a = api.get(&format!("{path}?{bad}"), auth).await;
            assert_invalid(&a, format!("{path}?{bad}"));
        }
    }
}

/// An Idempotency-Key sent literally in the form a long key is hashed to
/// (`sha256:<hex>`) is a key of its own: its observation is queued, not
/// dropped as a resend of the long key's.
#[tokio::test]
async fn a_key_spelt_like_a_hashed_key_is_not_that_key() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    let body = json!({"organization_id": org, "entity": "db-1", "attributes": {}});
    let observation: Observation = serde_json::from_value(body.clone()).unwrap();
    let long = "k".repeat(300);
    let hashed = observation.dedup_id(&long);
    let literal = hashed.strip_prefix(&format!("{org}/")).unwrap();
    assert!(literal.starts_with("sha256:"), "{hashed}");
    for k in [long.as_str(), literal] {
        let a = api
            .post_with_key("/v1/observations", &key, k, body.clone())
            .await;
        assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
        assert_eq!(a.body["duplicate"], false, "{k}");
    }
    assert_eq!(api.queue.stats().await.unwrap().depth, 2);
}

/// Two Idempotency-Key headers on one request are refused: which one keys
/// it would be a guess, and a retry sending the other would run it again.
#[tokio::test]
async fn an_idempotency_key_sent_twice_is_refused() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let request = Request::post("/v1/incidents")
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .header("Idempotency-Key", "first")
        .header("Idempotency-Key", "second")
        .body(Body::from(json!({"title": "db down"}).to_string()))
        .unwrap();
    assert_invalid(&api.raw(request).await, "two keys");
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.incidents").await,
        0
    );
}

/// An empty Idempotency-Key is refused (422), not shared by every later
/// request sending one; nothing is queued.
#[tokio::test]
async fn an_empty_idempotency_key_on_an_observation_is_refused() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    for entity in ["a", "b"] {
        let body = json!({"organization_id": org, "entity": entity, "attributes": {}});
        let a = api.post_with_key("/v1/observations", &key, "", body).await;
        assert_invalid(&a, entity);
    }
    assert_eq!(api.queue.stats().await.unwrap().depth, 0);
}

/// A path segment that cannot be a key prefix (a NUL, too short, upper
/// case) is refused before it reaches SQL.
#[tokio::test]
async fn a_key_prefix_that_cannot_be_one_is_refused() {
    let api = setup().await;
    let (org, _) = api.organization("acme").await;
    for prefix in ["%00", "abc", "ABCDEF012345", "0123456789ab%00", "%C3%A9"] {
        let a = api
            .delete(&format!("/v1/organizations/{org}/keys/{prefix}"), ADMIN)
            .await;
        assert_invalid(&a, prefix);
    }
    let a = api
        .delete(&format!("/v1/organizations/{org}/keys/0123456789ab"), ADMIN)
        .await;
    assert_eq!((a.status, a.code()), (StatusCode::NOT_FOUND, "not_found"));
}

/// Names count characters, like the documented limit and the tables'
/// CHECKs, and the queue's group and deduplication ids count bytes: 200
/// two-byte characters as an entity or a message id are accepted.
#[tokio::test]
async fn limits_in_characters_agree_with_the_queues_limits_in_bytes() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    for (entity, message_id) in [
        ("é".repeat(66), "m".repeat(200)),
        ("é".repeat(200), "é".repeat(100)),
        ("é".repeat(200), "é".repeat(200)),
    ] {
        let body = json!({"organization_id": org, "entity": entity, "attributes": {},
                          "message_id": message_id});
        let a = api.post("/v1/observations", &key, body).await;
        assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    }
    let a = api
        .post(
            "/v1/entities",
            &key,
            json!({"external_id": "é".repeat(200)}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let a = api
        .post(
            "/v1/entities",
            &key,
            json!({"external_id": "é".repeat(201)}),
        )
        .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.body);
}

/// Bodies must be JSON objects: an array (which serde would read as the
/// fields in order) is 422, and changes nothing.
#[tokio::test]
async fn json_arrays_are_not_objects() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let incident = api.declare(&key, "db down").await;
    let i = id(&incident);
    for (uri, body) in [
        (format!("/v1/incidents/{i}/resolve"), json!(["x"])),
        (format!("/v1/incidents/{i}/acknowledge"), json!(["x"])),
        (
            "/v1/policies".to_owned(),
            json!(["p", "never", ["x", "gt", 1.0]]),
        ),
        ("/v1/incidents".to_owned(), json!(["t"])),
        ("/v1/entities".to_owned(), json!(["e"])),
        ("/v1/incidents".to_owned(), json!("t")),
    ] {
        let a = api.post(&uri, &key, body.clone()).await;
        assert_invalid(&a, format!("{uri} {body}"));
    }
    let a = api.get(&format!("/v1/incidents/{i}"), &key).await;
    assert_eq!(a.body["lifecycle"], "OPEN");
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.policies").await,
        0
    );
}

/// A name sent twice in one object of attributes (`{"a": 1, "a": 2}`, at
/// any depth) is 422 with nothing stored or queued: serde_json keeps the
/// last of the two, `jsonb` would too, and the value read back would not
/// be the one a client whose parser keeps the first sent. The fields of
/// the bodies themselves are refused so already (`duplicate field`). The
/// answer names the name, and no position: serde_json's would count from
/// the start of the object holding it, not of the body.
#[tokio::test]
async fn a_name_sent_twice_in_one_object_is_refused() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    for (attributes, name) in [
        (r#"{"cpu": 1, "cpu": 2}"#, "cpu"),
        (r#"{"disk": {"used": 1, "free": 2, "used": 3}}"#, "used"),
        (r#"{"hosts": [{"a": 1}, {"b": 1, "b": 1}]}"#, "b"),
        (r#"{"cpu": 1, "\u0063pu": 2}"#, "cpu"),
    ] {
        for (uri, a) in api.send_attributes(org, &key, attributes).await {
            assert_invalid(&a, format!("{uri} {attributes}"));
            assert_eq!(
                a.body["error"]["message"],
                format!("the name {name:?} is sent twice in one object"),
                "{uri} {attributes}"
            );
        }
    }
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.entities").await,
        0
    );
    assert_eq!(api.queue.stats().await.unwrap().depth, 0, "nothing queued");
    // The same names in different objects are different names.
    let attributes = json!({"a": {"b": 1}, "c": {"b": 1}, "b": [{"b": 1}, {"b": 2}]});
    api.assert_attributes_read_back(&key, &attributes).await;
}

/// A string escaping a lone UTF-16 surrogate (`"\ud800"`, a trailing one
/// alone, a leading one followed by anything but its pair) is JSON, which
/// RFC 8259's grammar allows, but no Rust string holds it: 422, like a
/// number the API cannot keep, not 400 `malformed_json`, with nothing
/// written. (A broken escape, `"\u12"`, is still 400: see
/// `malformed_and_hostile_input_gets_json_errors_and_writes_nothing`.)
#[tokio::test]
async fn a_lone_surrogate_is_invalid_not_malformed() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    for string in [
        r#""\ud800""#,
        r#""\udc00x""#,
        r#""\ud800\u0041""#,
        r#""\ud800\n""#,
    ] {
        for (uri, body) in [
            (
                "/v1/entities",
                format!(r#"{{"external_id": "db-1", "attributes": {{"note": {string}}}}}"#),
            ),
            ("/v1/incidents", format!(r#"{{"title": {string}}}"#)),
        ] {
            let a = api
                .send(Method::POST, uri, Some(&key), Body::from(body))
                .await;
            assert_invalid(&a, format!("{uri} {string}"));
        }
    }
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.entities").await
            + api.count("SELECT count(*) FROM incidents.incidents").await,
        0
    );
}

/// JSON nested deeper than the API reads (serde_json reads 127 levels, the
/// body's own object one of them) is 422 with a message that says how deep
/// a body may nest, not one about strings a body cannot keep (the answer
/// of a lone surrogate escape, `"\ud800"`), which told the client to look
/// for the wrong thing. Nothing is written or queued. Attributes nested
/// well within the bound are taken and read back equal.
#[tokio::test]
async fn json_nested_too_deep_is_answered_as_too_deep() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    let nested = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
    // Attributes 124 deep: the entity listing, which holds them two
    // levels down, is 127 levels deep, as deep as this test reads.
    let deepest = format!("{{\"a\": {}}}", nested(123));
    let deepest: Value = serde_json::from_str(&deepest).unwrap();
    api.assert_attributes_read_back(&key, &deepest).await;
    let mut answers = Vec::new();
    for depth in [126, 127, 1000] {
        let attributes = format!("{{\"a\": {}}}", nested(depth));
        for (uri, a) in api.send_attributes(org, &key, &attributes).await {
            answers.push((format!("{uri} attributes {}", depth + 1), a));
        }
    }
    let wrong: Vec<String> = answers
        .iter()
        .filter(|(_, a)| {
            a.status != StatusCode::UNPROCESSABLE_ENTITY
                || a.code() != "invalid"
                || !a.body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("nest"))
        })
        .map(|(what, a)| format!("{what}: {} {}", a.status, a.body))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
    // Not an object, however deep: 422 too.
    let a = api
        .send(
            Method::POST,
            "/v1/incidents",
            Some(&key),
            Body::from(nested(1000)),
        )
        .await;
    assert_invalid(&a, "an array 1000 deep");
    let a = api.get("/v1/entities", &key).await;
    assert_eq!(a.body["entities"].as_array().unwrap().len(), 1);
    assert_eq!(a.body["entities"][0]["attributes"], deepest);
    assert_eq!(api.queue.stats().await.unwrap().depth, 0, "nothing queued");
}

/// Attributes are taken only as deep as every answer that carries them can
/// be read: the entity listing holds them three levels down
/// (`{"entities": [{"attributes": ...}]}`), and serde_json, like other
/// JSON readers, stops at 128 levels. Attributes 125 or 126 deep fit in a
/// request (127 levels with its object) and were stored, after which no
/// such client could read a page of the organization's entities that
/// listed them. Now they are 422, as entity and as observation, with
/// nothing stored or queued; 124 deep are taken and listed.
#[tokio::test]
async fn attributes_nest_no_deeper_than_every_answer_can_carry() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    let nested = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
    let mut wrong = Vec::new();
    for depth in [125, 126] {
        let attributes = format!("{{\"a\": {}}}", nested(depth - 1));
        for (uri, a) in api.send_attributes(org, &key, &attributes).await {
            if (a.status, a.code()) != (StatusCode::UNPROCESSABLE_ENTITY, "invalid") {
                wrong.push(format!(
                    "{uri} attributes {depth} deep: {} {}",
                    a.status, a.body
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.entities").await,
        0
    );
    assert_eq!(api.queue.stats().await.unwrap().depth, 0, "nothing queued");
    let deepest = format!("{{\"a\": {}}}", nested(123));
    let deepest: Value = serde_json::from_str(&deepest).unwrap();
    api.assert_attributes_read_back(&key, &deepest).await;
}

/// `PUT /v1/entities/{id}/singleton` waits for the entity's lock (held by
/// a guarded incident write of the entity until it commits) at most
/// `service.entity_lock_timeout`, then answers 503 `busy` with nothing
/// written; once the holder is done, the same request is made. It waited
/// as long as the holder took, holding its pooled connection (and a
/// graceful stop) all along. Step by step: A holds the entity's lock; B's
/// request is seen blocked by A in pg_locks, then answered.
#[tokio::test]
async fn the_singleton_flag_waits_for_the_entitys_lock_only_so_long() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let entity = api
        .post("/v1/entities", &key, json!({"external_id": "db-1"}))
        .await;
    let entity = id(&entity.body);
    let race = Interleaving::new(api._db.options()).await.unwrap();
    let a = race.session("A").await.unwrap();
    let b = race.session("B").await.unwrap();
    // B's API runs on B's one connection, which the harness watches. Its
    // bound is well within the harness's step timeout, which the wait
    // without a bound runs into instead.
    let config = ServiceConfig {
        entity_lock_timeout: Duration::from_secs(2),
        ..ServiceConfig::default()
    };
    let service = Service::new(b.pool().clone(), config).unwrap();
    let state = ApiState::new(service, api.queue.clone(), None, ApiConfig::default()).unwrap();
    let on_b = router(state);
    let put = || {
        Request::put(format!("/v1/entities/{entity}/singleton"))
            .header(header::AUTHORIZATION, format!("Bearer {key}"))
            .body(Body::from(json!({"singleton": true}).to_string()))
            .unwrap()
    };
    let mut tx = a.pool().begin().await.unwrap();
    let lock = pgonce_incidents::service::entity_lock_key(entity).unwrap();
    race.step(
        &a,
        "hold the entity lock",
        pgonce::lock::lock(&mut tx, lock),
    )
    .await
    .unwrap()
    .unwrap();
    let waiting = race
        .step_blocks(&b, "PUT singleton", on_b.clone().oneshot(put()))
        .await
        .unwrap();
    assert_eq!(waiting.blocked_by(), ["A"]);
    let response = waiting.resume().await.unwrap().unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("busy")),
        "{body}"
    );
    let unchanged = api.get(&format!("/v1/entities/{entity}"), &key).await;
    assert_eq!(unchanged.body["singleton_incidents"], false);
    race.step(&a, "COMMIT", tx.commit()).await.unwrap().unwrap();
    // B's one connection is back in its pool, its transaction ended.
    let response = race
        .step(&b, "PUT singleton again", on_b.clone().oneshot(put()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let changed = api.get(&format!("/v1/entities/{entity}"), &key).await;
    assert_eq!(changed.body["singleton_incidents"], true);
}

/// The same Idempotency-Key with another declaration is 422; with the same
/// one, the first incident.
#[tokio::test]
async fn a_reused_idempotency_key_with_another_body_is_refused() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    let first = api
        .post_with_key("/v1/incidents", &key, "k-1", json!({"title": "db down"}))
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let again = api
        .post_with_key("/v1/incidents", &key, "k-1", json!({"title": "db down"}))
        .await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.body);
    assert_eq!(id(&again.body), id(&first.body));
    for other in [
        json!({"title": "api down"}),
        json!({"title": "db down", "actor": "bob"}),
    ] {
        let a = api
            .post_with_key("/v1/incidents", &key, "k-1", other.clone())
            .await;
        assert_invalid(&a, other);
    }
    assert_eq!(
        api.count("SELECT count(*) FROM incidents.incidents").await,
        1
    );
}

/// An integer spelt with a zero fraction is an integer, as JSON Schema's
/// `integer` says; a fraction is not.
#[tokio::test]
async fn integers_may_be_spelt_with_a_zero_fraction() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    let a = api
        .put("/v1/settings", ADMIN, json!({"rollout_percent": 38.0}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["rollout_percent"], 38);
    let a = api
        .put("/v1/settings", ADMIN, json!({"rollout_percent": 38.5}))
        .await;
    assert_invalid(&a, "38.5");
    let body = json!({"organization_id": org as f64, "entity": "e", "attributes": {}});
    let a = api.post("/v1/observations", &key, body).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
}

/// Negative positions and ids in a query are refused as the document says
/// (`minimum: 0`).
#[tokio::test]
async fn negative_query_positions_and_ids_are_refused() {
    let api = setup().await;
    let (_, key) = api.organization("acme").await;
    for uri in [
        "/v1/entities?after=-1",
        "/v1/events?after=-1",
        "/v1/incidents?policy_id=-1",
        "/v1/incidents?entity_id=-1",
        "/v1/incidents?before=-1",
        "/v1/incidents?limit=501",
        "/v1/entities?limit=501",
    ] {
        let a = api.get(uri, &key).await;
        assert_invalid(&a, uri);
    }
}

/// The document states what the validation checks: lengths and control
/// characters of names, titles, actors, external ids and keys; attributes
/// are objects; each listing's largest page; the rollout's 0-100; and each
/// error status on its own, with no catch-all `default`.
#[tokio::test]
async fn the_document_states_the_validations_limits() {
    let api = setup().await;
    let doc = api.get("/openapi.json", "unused").await.body;
    let schemas = &doc["components"]["schemas"];
    let name = &schemas["NewOrganization"]["properties"]["name"];
    assert_eq!(
        (name["minLength"].clone(), name["maxLength"].clone()),
        (json!(1), json!(200))
    );
    assert_eq!(name["pattern"], pgonce_incidents::model::NAME_PATTERN);
    let declaration = &schemas["NewDeclaration"]["properties"];
    assert_eq!(declaration["title"]["maxLength"], 1000);
    assert_eq!(
        declaration["title"]["pattern"],
        pgonce_incidents::model::TITLE_PATTERN
    );
    for field in ["entity", "idempotency_key", "actor"] {
        assert_eq!(declaration[field]["maxLength"], 200, "{field}");
        assert!(declaration[field]["pattern"].is_string(), "{field}");
    }
    assert_eq!(schemas["Action"]["properties"]["actor"]["maxLength"], 200);
    assert_eq!(
        schemas["NewEntity"]["properties"]["external_id"]["maxLength"],
        200
    );
    for body in ["NewEntity", "Observation"] {
        assert_eq!(
            schemas[body]["properties"]["attributes"]["$ref"], "#/components/schemas/Attributes",
            "{body}"
        );
    }
    assert_eq!(schemas["Attributes"]["type"], "object");
    let description = schemas["Attributes"]["description"].as_str().unwrap();
    assert!(
        description.contains(&format!("at most {PRINTED_ATTRIBUTES_ALLOWANCE} bytes")),
        "{description}"
    );
    assert_eq!(schemas["NewKey"]["properties"]["name"]["maxLength"], 200);
    assert_eq!(
        schemas["Settings"]["properties"]["rollout_percent"]["maximum"],
        100
    );
    let parameter = |path: &str, name: &str| {
        doc["paths"][path]["get"]["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap()["schema"]
            .clone()
    };
    assert_eq!(parameter("/v1/incidents", "limit")["maximum"], 500);
    for listing in ["/v1/entities", "/v1/policies", "/v1/organizations"] {
        assert_eq!(parameter(listing, "limit")["maximum"], 500, "{listing}");
        assert_eq!(parameter(listing, "limit")["default"], 100, "{listing}");
        assert_eq!(parameter(listing, "after")["minimum"], 0, "{listing}");
    }
    assert_eq!(parameter("/v1/events", "limit")["maximum"], 1000);
    assert_eq!(parameter("/v1/incidents", "policy_id")["minimum"], 0);
    let prefix = &doc["paths"]["/v1/organizations/{org_id}/keys/{prefix}"]["delete"];
    assert!(
        prefix["parameters"][1]["schema"]["pattern"].is_string(),
        "{prefix}"
    );
    for (path, methods) in doc["paths"].as_object().unwrap() {
        for (method, operation) in methods.as_object().unwrap() {
            let responses = operation["responses"].as_object().unwrap();
            assert!(!responses.contains_key("default"), "{method} {path}");
            assert!(responses.contains_key("500"), "{method} {path}");
        }
    }
    let declare = &doc["paths"]["/v1/incidents"]["post"]["responses"];
    for status in ["400", "401", "404", "408", "409", "413", "422"] {
        assert_eq!(
            declare[status]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/Error",
            "{status}"
        );
    }
}

/// The API of organization `acme` on a fresh database, its observations
/// queue on a moto server's SQS, whose client makes `max_attempts` per call.
struct OnSqs {
    _db: ScratchDatabase,
    _moto: pgonce_testkit::Moto,
    org: i64,
    key: String,
    sqs: pgonce_sqs::SqsClient,
    queue: pgonce_sqs::SqsQueue,
    router: Router,
}

impl OnSqs {
    /// POST an observation of `db-1` with `note`: the answer's status and
    /// JSON body.
    async fn observe(&self, note: &str) -> (StatusCode, Value) {
        let body =
            json!({"organization_id": self.org, "entity": "db-1", "attributes": {"note": note}});
        let request = Request::post("/v1/observations")
            .header(header::AUTHORIZATION, format!("Bearer {}", self.key))
            .body(Body::from(body.to_string()))
            .unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice::<Value>(&bytes).unwrap())
    }
}

async fn on_sqs(max_attempts: u32) -> OnSqs {
    let (db, pool) = pgonce_testkit::fresh_migrated_database(4, pgonce_incidents::migrate).await;
    let service = Service::new(pool.clone(), ServiceConfig::default()).unwrap();
    let (org, key) = pgonce_incidents::store::create_organization(&pool, "acme")
        .await
        .unwrap();
    let moto = pgonce_testkit::Moto::start().unwrap_or_else(|e| panic!("{e}"));
    let config = pgonce_sqs::SqsConfig {
        max_attempts,
        ..pgonce_sqs::SqsConfig::local(moto.endpoint())
    };
    let sqs = pgonce_sqs::SqsClient::connect(config).await.unwrap();
    let queue = sqs
        .create_queue("observations.fifo", pgonce::QueueAttributes::fifo())
        .await
        .unwrap();
    let state = ApiState::new(service, queue.clone(), None, ApiConfig::default()).unwrap();
    OnSqs {
        _db: db,
        _moto: moto,
        org: org.id,
        key,
        sqs,
        queue,
        router: router(state),
    }
}

/// An observation whose names or strings hold U+FFFE or U+FFFF, which the
/// API takes everywhere else (an entity's external id, its attributes), is
/// queued on Amazon SQS too, and its delivery reads back as sent: SQS takes
/// only XML's characters in a body, which those two are not, so the body
/// escapes them (`\ufffe`) instead of the queue refusing it as invalid.
#[tokio::test]
async fn an_observation_with_noncharacters_is_queued_on_sqs_as_sent() {
    let sqs = on_sqs(pgonce_sqs::SqsConfig::default().max_attempts).await;
    let sent = Observation {
        organization_id: sqs.org,
        entity: "db-\u{FFFE}".into(),
        attributes: json!({"note\u{FFFF}": "\u{FFFE}\u{FFFF}", "cpu": 1}),
        message_id: Some("m-\u{FFFF}".into()),
    };
    let request = Request::post("/v1/observations")
        .header(header::AUTHORIZATION, format!("Bearer {}", sqs.key))
        .body(Body::from(serde_json::to_string(&sent).unwrap()))
        .unwrap();
    let response = sqs.router.oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    let wait = ReceiveRequest {
        wait: Duration::from_secs(5),
        ..ReceiveRequest::up_to(1)
    };
    let delivered = sqs.queue.receive(wait).await.unwrap().remove(0);
    assert_eq!(Observation::parse(&delivered.body).unwrap(), sent);
}

/// A queue backend that refuses a send for now (Amazon SQS throttling it,
/// `RequestThrottled`: moto refuses a send whose body holds
/// `Moto::FAIL_REQUEST`) is 503 `unavailable` with the API's own message,
/// not 500 `internal`: the observation was valid, nothing was queued, and
/// the same request succeeds once the backend takes it. (The SDK's own
/// retries are off, so that the refusal reaches the API at once.)
#[tokio::test]
async fn a_queue_backend_refusing_a_send_is_unavailable() {
    let sqs = on_sqs(1).await;

    let (status, body) = sqs.observe(pgonce_testkit::Moto::FAIL_REQUEST).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(!message.contains("Rate exceeded"), "{message}");
    assert_eq!(sqs.queue.stats().await.unwrap().depth, 0);

    let (status, body) = sqs.observe("taken").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(sqs.queue.stats().await.unwrap().depth, 1);
}

/// An observations queue deleted by hand, on PostgreSQL
/// (`DELETE FROM pgonce.queue`) and on Amazon SQS (`DeleteQueue`), is 503
/// `unavailable` with the API's own message, not 500 `internal`: nothing
/// can be taken until an operator creates the queue again (the log names
/// it and says how), and the same request is accepted once it exists.
#[tokio::test]
async fn an_observations_queue_deleted_by_hand_is_unavailable() {
    let api = setup().await;
    let (org, key) = api.organization("acme").await;
    let body = json!({"organization_id": org, "entity": "db-1", "attributes": {"cpu": 1}});
    let a = api.post("/v1/observations", &key, body.clone()).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    sqlx::query("DELETE FROM pgonce.queue WHERE name = $1")
        .bind(pgonce_incidents::runtime::OBSERVATIONS_QUEUE)
        .execute(&api.pool)
        .await
        .unwrap();
    let a = api.post("/v1/observations", &key, body.clone()).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.body);
    assert_eq!(a.code(), "unavailable", "{}", a.body);
    let message = a.body["error"]["message"].as_str().unwrap();
    assert!(!message.contains("incidents-observations"), "{message}");
    observations_queue(&api.pool, Duration::from_secs(30), 5)
        .await
        .unwrap();
    let a = api.post("/v1/observations", &key, body).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.body);
    assert_eq!(api.queue.stats().await.unwrap().depth, 1);

    let sqs = on_sqs(1).await;
    sqs.sqs
        .sdk()
        .delete_queue()
        .queue_url(sqs.queue.url())
        .send()
        .await
        .unwrap();
    let (status, body) = sqs.observe("gone").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(!message.contains("observations.fifo"), "{message}");
    sqs.sqs
        .create_queue("observations.fifo", pgonce::QueueAttributes::fifo())
        .await
        .unwrap();
    let (status, body) = sqs.observe("taken").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(sqs.queue.stats().await.unwrap().depth, 1);
}

/// Values of every kind for [`pgonce::json::text_lengths`]: doubles of any
/// bits, of every decimal exponent from 1e-324 to 1e308 with 1 to 17
/// digits, whole doubles of the 64-bit ranges, both zeros, integers of
/// both 64-bit ranges; and objects of them nested in arrays and objects,
/// with strings holding every escape, and characters past ASCII.
fn values_of_every_kind() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let double = prop_oneof![
        any::<u64>().prop_map(f64::from_bits),
        (1..=17i32, -324..=308i32, any::<bool>()).prop_map(|(digits, exponent, negative)| {
            let sign = if negative { "-" } else { "" };
            let mantissa = "7".repeat(digits as usize);
            format!("{sign}{mantissa}e{}", exponent - digits + 1)
                .parse::<f64>()
                .unwrap()
        }),
        any::<i64>().prop_map(|i| i as f64),
        any::<u64>().prop_map(|u| u as f64),
        Just(-0.0),
        Just(0.0),
    ]
    .prop_filter_map("finite", |f| {
        serde_json::Number::from_f64(f).map(Value::Number)
    });
    let number = prop_oneof![
        4 => double,
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => (-1000..1000i64).prop_map(Value::from),
    ]
    .boxed();
    let string = "[\\x01-\\x7f\u{e9}\u{2028}\u{1F600}]{0,12}";
    let scalar = prop_oneof![
        6 => number.clone(),
        2 => string.prop_map(Value::from),
        1 => any::<bool>().prop_map(Value::from),
        1 => Just(Value::Null),
    ];
    let nested = scalar.prop_recursive(3, 16, 4, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map(string, inner, 0..4)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    });
    prop_oneof![
        3 => number,
        1 => nested.prop_map(|value| json!({ "a": value })),
    ]
}

/// The lengths `pgonce::json::text_lengths` counts, which bound what
/// attributes may print as and what a statement may send, are the lengths
/// of serde_json's compact text, of the text pgonce stores, and of
/// PostgreSQL's text (`jsonb::text`) of the value once stored, on
/// 4000 values drawn by proptest: doubles and integers of every size,
/// and objects holding strings with every escape.
#[tokio::test]
async fn the_lengths_counted_are_what_serde_json_writes_and_postgresql_prints() {
    use proptest::strategy::{Strategy as _, ValueTree as _};
    let api = setup().await;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = values_of_every_kind();
    let values: Vec<Value> = (0..4000)
        .map(|_| strategy.new_tree(&mut runner).unwrap().current())
        .collect();
    let stored: Vec<String> = values
        .iter()
        .map(|v| pgonce::json::stored(v).0.get().to_owned())
        .collect();
    let printed: Vec<i64> = sqlx::query_scalar(
        "SELECT octet_length(t::jsonb::text)::bigint \
         FROM unnest($1::text[]) WITH ORDINALITY AS u(t, i) ORDER BY i",
    )
    .bind(&stored)
    .fetch_all(&api.pool)
    .await
    .unwrap();
    let mut wrong = Vec::new();
    for ((value, stored), printed) in values.iter().zip(&stored).zip(printed) {
        let counted = pgonce::json::text_lengths(value);
        let compact = value.to_string().len();
        let lengths = (counted.compact, counted.printed, counted.stored);
        if lengths != (compact, printed as usize, stored.len()) {
            wrong.push(format!(
                "{stored}: counted {counted:?}, written {compact}, printed {printed}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{} of 4000: {wrong:#?}", wrong.len());
}
