//! The OpenAPI 3.1 document served at `/openapi.json`, built from
//! [`ROUTES`] (a test sends a request to every entry and checks the router
//! has it): paths, typed parameters, security, and the JSON Schema of every
//! request body and success response. Bodies and domain objects are
//! derived from the Rust types the handlers use (`schemars`, JSON Schema
//! 2020-12, the dialect OpenAPI 3.1 uses), so the document cannot drift
//! from what the API accepts; the envelopes around them (`{"incidents":
//! [...], "next_before": n}`) are written here, beside the routes.

use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, SchemaGenerator};
use serde_json::{Map, Value, json};

use super::{
    Action, NewDeclaration, NewEntity, NewKey, NewOrganization, NewPolicy, Settings, SingletonFlag,
};
use crate::model::{Entity, Incident, Observation, Organization, Policy};

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Auth {
    /// No credentials (health, metrics, this document).
    None,
    /// An organization's API key.
    ApiKey,
    /// The admin token.
    Admin,
}

/// One documented route.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    /// The HTTP method, upper case (`GET`).
    pub method: &'static str,
    /// axum syntax: `{id}` is a path parameter.
    pub path: &'static str,
    /// The credentials the route needs.
    pub auth: Auth,
    /// The success status.
    pub status: u16,
    /// One line for the OpenAPI operation's `summary`.
    pub summary: &'static str,
    /// Query parameters (all optional; their types are set by name).
    pub query: &'static [&'static str],
    /// The request body's schema, and whether it may be left out.
    pub body: Option<(SchemaFn, Need)>,
    /// The success response's JSON schema (none: no JSON body).
    pub response: Option<SchemaFn>,
    /// The `Idempotency-Key` header the route reads (none: it reads none).
    pub idempotency_key: Option<KeyHeader>,
}

/// The `Idempotency-Key` header of a route, for its OpenAPI parameter:
/// optional, visible ASCII that neither starts nor ends with a space (HTTP
/// trims those, so a key of spaces arrives empty and is refused), sent once.
#[derive(Debug, Clone, Copy)]
pub struct KeyHeader {
    /// The longest key the route takes, in characters (none: any length).
    pub max_length: Option<usize>,
    /// What the route does with it.
    pub description: &'static str,
}

impl KeyHeader {
    fn parameter(&self) -> Value {
        let mut schema =
            json!({"type": "string", "minLength": 1, "pattern": super::IDEMPOTENCY_KEY_PATTERN});
        if let Some(max) = self.max_length {
            schema["maxLength"] = json!(max);
        }
        json!({"name": crate::notifier::IDEMPOTENCY_HEADER, "in": "header", "required": false,
               "description": self.description, "schema": schema})
    }
}

/// Whether a request body is required.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The body must be sent (`requestBody.required` is true).
    Required,
    /// The body may be left out (`requestBody.required` is false).
    Optional,
}

/// Writes a schema, registering the named ones it refers to.
pub type SchemaFn = fn(&mut SchemaGenerator) -> Value;

const fn route(
    method: &'static str,
    path: &'static str,
    auth: Auth,
    status: u16,
    summary: &'static str,
) -> Route {
    Route {
        method,
        path,
        auth,
        status,
        summary,
        query: &[],
        body: None,
        response: None,
        idempotency_key: None,
    }
}

/// The schema of `T`: a `$ref` to `#/components/schemas/T` for named types.
fn of<T: JsonSchema>(g: &mut SchemaGenerator) -> Value {
    g.subschema_for::<T>().to_value()
}

/// An object with these required properties.
fn object(properties: Vec<(&str, Value)>) -> Value {
    let required: Vec<&str> = properties.iter().map(|(name, _)| *name).collect();
    let properties: Map<String, Value> = properties
        .into_iter()
        .map(|(name, schema)| (name.to_owned(), schema))
        .collect();
    json!({"type": "object", "required": required, "properties": properties})
}

fn array(items: Value) -> Value {
    json!({"type": "array", "items": items})
}

fn integer() -> Value {
    json!({"type": "integer", "format": "int64"})
}

/// A stored event, as the timeline and the feed return it.
fn event(_: &mut SchemaGenerator) -> Value {
    object(vec![
        ("position", integer()),
        ("type", json!({"type": "string"})),
        ("tags", array(json!({"type": "string"}))),
        ("data", json!({})),
        ("metadata", json!({})),
    ])
}

fn created_organization(g: &mut SchemaGenerator) -> Value {
    object(vec![
        ("organization", of::<Organization>(g)),
        (
            "api_key",
            json!({"type": "string", "description": "shown once; stored hashed"}),
        ),
    ])
}

/// A page of a listing by id: its rows under `list`, and `next_after`.
fn id_page(list: &str, rows: Value) -> Value {
    object(vec![
        (list, array(rows)),
        (
            "next_after",
            json!({
                "type": ["integer", "null"], "format": "int64",
                "description": "pass as `after` for the next page; null on the last"
            }),
        ),
    ])
}

fn organization_page(g: &mut SchemaGenerator) -> Value {
    id_page("organizations", of::<Organization>(g))
}

fn created_key(_: &mut SchemaGenerator) -> Value {
    object(vec![
        ("organization_id", integer()),
        ("api_key", json!({"type": "string"})),
        ("prefix", json!({"type": "string"})),
    ])
}

fn settings(_: &mut SchemaGenerator) -> Value {
    object(vec![(
        "rollout_percent",
        json!({"type": "integer", "minimum": 0, "maximum": 100}),
    )])
}

fn entity_page(g: &mut SchemaGenerator) -> Value {
    id_page("entities", of::<Entity>(g))
}

fn policy_page(g: &mut SchemaGenerator) -> Value {
    id_page("policies", of::<Policy>(g))
}

fn incident_page(g: &mut SchemaGenerator) -> Value {
    object(vec![
        ("incidents", array(of::<Incident>(g))),
        (
            "next_before",
            json!({"type": ["integer", "null"], "format": "int64"}),
        ),
    ])
}

fn timeline(g: &mut SchemaGenerator) -> Value {
    object(vec![("events", array(event(g)))])
}

fn feed_page(g: &mut SchemaGenerator) -> Value {
    object(vec![
        ("events", array(event(g))),
        (
            "next",
            json!({"type": "integer", "format": "int64", "description": "pass as `after` next"}),
        ),
    ])
}

fn queued(_: &mut SchemaGenerator) -> Value {
    object(vec![
        ("message_id", json!({"type": "string"})),
        ("duplicate", json!({"type": "boolean"})),
    ])
}

fn status(_: &mut SchemaGenerator) -> Value {
    object(vec![("status", json!({"type": "string"}))])
}

/// A query parameter's schema, by route and name: what the handler checks
/// (ids and positions not negative, each listing's page size).
fn query_parameter(path: &str, name: &str) -> Value {
    match name {
        "lifecycle" => json!({"type": "string", "enum": ["OPEN", "ACKNOWLEDGED", "RESOLVED"]}),
        "limit" => {
            let (max, default) = match path {
                "/v1/events" => (1000, 100),
                "/v1/entities" | "/v1/policies" | "/v1/organizations" => {
                    (crate::store::MAX_PAGE, super::DEFAULT_PAGE)
                }
                _ => (500, 50),
            };
            json!({"type": "integer", "minimum": 1, "maximum": max, "default": default})
        }
        "wait" => json!({
            "type": "integer", "minimum": 0, "maximum": u64::MAX,
            "description": "seconds; longer waits are shortened to the server's maximum"
        }),
        _ => json!({"type": "integer", "format": "int64", "minimum": 0, "maximum": i64::MAX}),
    }
}

/// The error answers a route can give, by status. Every one has the
/// [`super::ApiError`] body.
fn error_statuses(r: &Route) -> Vec<(u16, &'static str)> {
    let mut statuses = Vec::new();
    let has_path = r.path.contains('{');
    if r.body.is_some() {
        statuses.push((400, "the body is not JSON (`malformed_json`)"));
    }
    if r.auth != Auth::None {
        statuses.push((
            401,
            "missing, malformed, unknown or revoked credentials, or the Authorization header sent twice (`unauthorized`)",
        ));
        statuses.push((
            404,
            "no such resource in the caller's organization, or no such organization (`not_found`)",
        ));
    } else if r.path == "/metrics" {
        statuses.push((404, "metrics are off (`no_route`)"));
    }
    if r.body.is_some() {
        statuses.push((
            408,
            "the body did not arrive within the body timeout (`request_timeout`)",
        ));
    }
    if r.auth != Auth::None && r.method != "GET" {
        statuses.push((409, "the name exists, the lifecycle does not allow the change, or a conflicting write (`already_exists`, `invalid_transition`, `conflict`)"));
    }
    if r.body.is_some() {
        statuses.push((
            413,
            "the body is larger than the limit (`payload_too_large`)",
        ));
    }
    if r.body.is_some() || has_path || !r.query.is_empty() || r.path == "/v1/observations" {
        statuses.push((
            422,
            "invalid input: wrong types, unknown fields, out of range or not an object (`invalid`)",
        ));
    }
    statuses.push((
        500,
        "an internal error, details only in the server's log (`internal`)",
    ));
    statuses.push((
        503,
        "the database or the observations queue is busy or unavailable (a queue deleted by hand: until it is created again), or the connection pooler in front of the database is set up wrongly (`busy`, `unavailable`, `pooler`)",
    ));
    statuses
}

/// Every route of [`super::router`].
#[rustfmt::skip]
pub const ROUTES: &[Route] = &[
    Route {
        body: Some((of::<NewOrganization>, Need::Required)),
        response: Some(created_organization),
        ..route("POST", "/v1/organizations", Auth::Admin, 201, "Create an organization; returns its first API key")
    },
    Route {
        query: &["after", "limit"],
        response: Some(organization_page),
        ..route("GET", "/v1/organizations", Auth::Admin, 200, "List organizations by id (keyset: after)")
    },
    Route {
        body: Some((of::<NewKey>, Need::Optional)),
        response: Some(created_key),
        ..route("POST", "/v1/organizations/{org_id}/keys", Auth::Admin, 201, "Create another API key for an organization")
    },
    route("DELETE", "/v1/organizations/{org_id}/keys/{prefix}", Auth::Admin, 204, "Revoke an API key by its prefix"),
    Route {
        response: Some(settings),
        ..route("GET", "/v1/settings", Auth::Admin, 200, "Read the guard rollout percent")
    },
    Route {
        body: Some((of::<Settings>, Need::Required)),
        response: Some(settings),
        ..route("PUT", "/v1/settings", Auth::Admin, 200, "Set the guard rollout percent (0-100), effective without restart")
    },
    Route {
        body: Some((of::<NewEntity>, Need::Required)),
        response: Some(of::<Entity>),
        ..route("POST", "/v1/entities", Auth::ApiKey, 200, "Create an entity or replace its attributes (omitted: kept)")
    },
    Route {
        query: &["after", "limit"],
        response: Some(entity_page),
        ..route("GET", "/v1/entities", Auth::ApiKey, 200, "List entities by id (keyset: after)")
    },
    Route {
        response: Some(of::<Entity>),
        ..route("GET", "/v1/entities/{id}", Auth::ApiKey, 200, "Get an entity")
    },
    Route {
        body: Some((of::<SingletonFlag>, Need::Required)),
        response: Some(of::<Entity>),
        ..route("PUT", "/v1/entities/{id}/singleton", Auth::ApiKey, 200, "Set the entity's run-time singleton flag")
    },
    Route {
        body: Some((of::<NewPolicy>, Need::Required)),
        response: Some(of::<Policy>),
        ..route("POST", "/v1/policies", Auth::ApiKey, 201, "Create a policy")
    },
    Route {
        query: &["after", "limit"],
        response: Some(policy_page),
        ..route("GET", "/v1/policies", Auth::ApiKey, 200, "List policies by id (keyset: after)")
    },
    Route {
        response: Some(of::<Policy>),
        ..route("GET", "/v1/policies/{id}", Auth::ApiKey, 200, "Get a policy")
    },
    Route {
        query: &["lifecycle", "policy_id", "entity_id", "before", "limit"],
        response: Some(incident_page),
        ..route("GET", "/v1/incidents", Auth::ApiKey, 200, "List incidents, newest number first (keyset: before)")
    },
    Route {
        body: Some((of::<NewDeclaration>, Need::Required)),
        response: Some(of::<Incident>),
        idempotency_key: Some(KeyHeader {
            max_length: Some(crate::model::MAX_NAME),
            description: "Names the declaration: sent again with the same key, it answers the incident the first one declared, and with another title, entity or actor it is refused (422). The body's idempotency_key is the same key; when both are sent they must be equal.",
        }),
        ..route("POST", "/v1/incidents", Auth::ApiKey, 201, "Declare an incident by hand (Idempotency-Key header or body field)")
    },
    Route {
        response: Some(of::<Incident>),
        ..route("GET", "/v1/incidents/{id}", Auth::ApiKey, 200, "Get an incident")
    },
    Route {
        body: Some((of::<Action>, Need::Optional)),
        response: Some(of::<Incident>),
        ..route("POST", "/v1/incidents/{id}/acknowledge", Auth::ApiKey, 200, "Acknowledge an OPEN incident (409 otherwise)")
    },
    Route {
        body: Some((of::<Action>, Need::Optional)),
        response: Some(of::<Incident>),
        ..route("POST", "/v1/incidents/{id}/resolve", Auth::ApiKey, 200, "Resolve an OPEN or ACKNOWLEDGED incident (409 otherwise)")
    },
    Route {
        response: Some(timeline),
        ..route("GET", "/v1/incidents/{id}/timeline", Auth::ApiKey, 200, "An incident's events in order")
    },
    Route {
        query: &["after", "wait", "limit"],
        response: Some(feed_page),
        ..route("GET", "/v1/events", Auth::ApiKey, 200, "The organization's events after a position (long poll: wait seconds)")
    },
    Route {
        body: Some((of::<Observation>, Need::Required)),
        response: Some(queued),
        idempotency_key: Some(KeyHeader {
            max_length: None,
            description: "Queues the observation once within the pipeline queue's deduplication window: a resend with the same key answers the first message's id with duplicate true. Without it, the observation's message_id is the key. A long key is hashed.",
        }),
        ..route("POST", "/v1/observations", Auth::ApiKey, 202, "Send an observation to the pipeline's queue (Idempotency-Key header: deduplicated within the queue's window)")
    },
    route("GET", "/metrics", Auth::None, 200, "Prometheus metrics (text)"),
    Route {
        response: Some(status),
        ..route("GET", "/healthz", Auth::None, 200, "The process is up")
    },
    Route {
        response: Some(status),
        ..route("GET", "/readyz", Auth::None, 200, "The database answers and takes writes (not a standby, not read-only)")
    },
    route("GET", "/openapi.json", Auth::None, 200, "This document"),
];

fn path_parameters(path: &str) -> Vec<Value> {
    path.split('/')
        .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
        .map(|name| {
            let schema = if name == "prefix" {
                json!({"type": "string", "pattern": super::KEY_PREFIX_PATTERN,
                       "description": "the 12 hex digits after `pgo_` in the key"})
            } else {
                json!({"type": "integer", "format": "int64", "minimum": i64::MIN, "maximum": i64::MAX})
            };
            json!({"name": name, "in": "path", "required": true, "schema": schema})
        })
        .collect()
}

/// The document.
pub fn document() -> Value {
    // Named types land in components/schemas, where the $refs point.
    let mut generator = SchemaSettings::draft2020_12()
        .with(|s| s.definitions_path = "/components/schemas".into())
        .into_generator();
    let mut paths = Map::new();
    for r in ROUTES {
        let mut parameters = path_parameters(r.path);
        parameters.extend(r.query.iter().map(
            |q| json!({"name": q, "in": "query", "required": false, "schema": query_parameter(r.path, q)}),
        ));
        parameters.extend(r.idempotency_key.map(|h| h.parameter()));
        let security = match r.auth {
            Auth::None => json!([]),
            Auth::ApiKey => json!([{ "apiKey": [] }]),
            Auth::Admin => json!([{ "adminToken": [] }]),
        };
        let mut responses = Map::new();
        let success = match r.response {
            Some(schema) => json!({"description": "success", "content": {
                "application/json": {"schema": schema(&mut generator)}}}),
            None => json!({"description": "success"}),
        };
        responses.insert(r.status.to_string(), success);
        for (status, description) in error_statuses(r) {
            responses.insert(
                status.to_string(),
                json!({"description": description, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Error"}}}}),
            );
        }
        let mut operation = json!({
            "summary": r.summary,
            "parameters": parameters,
            "security": security,
            "responses": responses,
        });
        if let Some((schema, need)) = r.body {
            operation["requestBody"] = json!({
                "required": need == Need::Required,
                "content": {"application/json": {"schema": schema(&mut generator)}}
            });
        }
        let entry = paths
            .entry(r.path)
            .or_insert_with(|| Value::Object(Map::new()));
        entry[r.method.to_ascii_lowercase()] = operation;
    }
    let mut schemas = generator.take_definitions(true);
    schemas.insert(
        "Error".into(),
        json!({
            "type": "object",
            "required": ["error"],
            "properties": {"error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {"code": {"type": "string"}, "message": {"type": "string"}}
            }}
        }),
    );
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "pgonce incidents",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Organizations, entities, policies, incidents, their timeline and event feed, observation ingest. Errors: {\"error\": {\"code\", \"message\"}}."
        },
        "paths": paths,
        "components": {
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "An organization's API key, pgo_..."},
                "adminToken": {"type": "http", "scheme": "bearer", "description": "The server's admin token"}
            },
            "schemas": schemas
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `$ref` of the document names a schema it has.
    #[test]
    fn every_reference_resolves_in_the_components() {
        fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
            match v {
                Value::Object(m) => {
                    if let Some(Value::String(r)) = m.get("$ref") {
                        out.push(r);
                    }
                    m.values().for_each(|x| refs(x, out));
                }
                Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
                _ => {}
            }
        }
        let doc = document();
        let mut found = Vec::new();
        refs(&doc, &mut found);
        assert!(found.len() > 10, "{found:?}");
        for r in found {
            let name = r
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("{r} points outside the components"));
            assert!(doc["components"]["schemas"][name].is_object(), "{r}");
        }
        let declare = &doc["paths"]["/v1/incidents"]["post"]["requestBody"];
        assert_eq!(declare["required"], true);
        let incident = &doc["components"]["schemas"]["Incident"];
        assert!(incident["properties"]["number"].is_object(), "{incident}");
        let limit = &doc["paths"]["/v1/incidents"]["get"]["parameters"];
        assert!(
            limit
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "limit" && p["schema"]["type"] == "integer")
        );
    }
}
