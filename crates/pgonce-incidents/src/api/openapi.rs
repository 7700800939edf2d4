//! The OpenAPI 3.1 document served at `/openapi.json`, written by hand from
//! [`ROUTES`] (a test sends a request to every entry and checks the router
//! has it). Kept small: paths, parameters, security and the error shape.

use serde_json::{Map, Value, json};

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
    pub method: &'static str,
    /// axum syntax: `{id}` is a path parameter.
    pub path: &'static str,
    pub auth: Auth,
    /// The success status.
    pub status: u16,
    pub summary: &'static str,
    /// Query parameters (all optional).
    pub query: &'static [&'static str],
}

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
    }
}

/// Every route of [`super::router`].
#[rustfmt::skip]
pub const ROUTES: &[Route] = &[
    route("POST", "/v1/organizations", Auth::Admin, 201, "Create an organization; returns its first API key"),
    route("GET", "/v1/organizations", Auth::Admin, 200, "List organizations"),
    route("POST", "/v1/organizations/{org_id}/keys", Auth::Admin, 201, "Create another API key for an organization"),
    route("DELETE", "/v1/organizations/{org_id}/keys/{prefix}", Auth::Admin, 204, "Revoke an API key by its prefix"),
    route("GET", "/v1/settings", Auth::Admin, 200, "Read the guard rollout percent"),
    route("PUT", "/v1/settings", Auth::Admin, 200, "Set the guard rollout percent (0-100), effective without restart"),
    route("POST", "/v1/entities", Auth::ApiKey, 200, "Create an entity or update its attributes"),
    Route {
        query: &["after", "limit"],
        ..route("GET", "/v1/entities", Auth::ApiKey, 200, "List entities by id (keyset: after)")
    },
    route("GET", "/v1/entities/{id}", Auth::ApiKey, 200, "Get an entity"),
    route("PUT", "/v1/entities/{id}/singleton", Auth::ApiKey, 200, "Set the entity's run-time singleton flag"),
    route("POST", "/v1/policies", Auth::ApiKey, 201, "Create a policy"),
    route("GET", "/v1/policies", Auth::ApiKey, 200, "List policies"),
    route("GET", "/v1/policies/{id}", Auth::ApiKey, 200, "Get a policy"),
    Route {
        query: &["lifecycle", "policy_id", "entity_id", "before", "limit"],
        ..route("GET", "/v1/incidents", Auth::ApiKey, 200, "List incidents, newest number first (keyset: before)")
    },
    route("POST", "/v1/incidents", Auth::ApiKey, 201, "Declare an incident by hand (Idempotency-Key header or body field)"),
    route("GET", "/v1/incidents/{id}", Auth::ApiKey, 200, "Get an incident"),
    route("POST", "/v1/incidents/{id}/acknowledge", Auth::ApiKey, 200, "Acknowledge an OPEN incident (409 otherwise)"),
    route("POST", "/v1/incidents/{id}/resolve", Auth::ApiKey, 200, "Resolve an OPEN or ACKNOWLEDGED incident (409 otherwise)"),
    route("GET", "/v1/incidents/{id}/timeline", Auth::ApiKey, 200, "An incident's events in order"),
    Route {
        query: &["after", "wait", "limit"],
        ..route("GET", "/v1/events", Auth::ApiKey, 200, "The organization's events after a position (long poll: wait seconds)")
    },
    route("POST", "/v1/observations", Auth::ApiKey, 202, "Send an observation to the pipeline's queue"),
    route("GET", "/metrics", Auth::None, 200, "Prometheus metrics"),
    route("GET", "/healthz", Auth::None, 200, "The process is up"),
    route("GET", "/readyz", Auth::None, 200, "The database answers"),
    route("GET", "/openapi.json", Auth::None, 200, "This document"),
];

fn path_parameters(path: &str) -> Vec<Value> {
    path.split('/')
        .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
        .map(|name| {
            let schema = if name == "prefix" {
                json!({"type": "string"})
            } else {
                json!({"type": "integer", "format": "int64"})
            };
            json!({"name": name, "in": "path", "required": true, "schema": schema})
        })
        .collect()
}

/// The document.
pub fn document() -> Value {
    let mut paths = Map::new();
    for r in ROUTES {
        let mut parameters = path_parameters(r.path);
        parameters.extend(r.query.iter().map(
            |q| json!({"name": q, "in": "query", "required": false, "schema": {"type": "string"}}),
        ));
        let security = match r.auth {
            Auth::None => json!([]),
            Auth::ApiKey => json!([{ "apiKey": [] }]),
            Auth::Admin => json!([{ "adminToken": [] }]),
        };
        let mut responses = Map::new();
        responses.insert(
            r.status.to_string(),
            json!({"description": "success", "content": {"application/json": {}}}),
        );
        responses.insert(
            "default".into(),
            json!({"description": "error", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Error"}}}}),
        );
        let mut operation = json!({
            "summary": r.summary,
            "parameters": parameters,
            "security": security,
            "responses": responses,
        });
        if matches!(r.method, "POST" | "PUT") {
            operation["requestBody"] = json!({
                "required": false,
                "content": {"application/json": {"schema": {"type": "object"}}}
            });
        }
        let entry = paths
            .entry(r.path)
            .or_insert_with(|| Value::Object(Map::new()));
        entry[r.method.to_ascii_lowercase()] = operation;
    }
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
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {
                        "type": "object",
                        "required": ["code", "message"],
                        "properties": {"code": {"type": "string"}, "message": {"type": "string"}}
                    }}
                }
            }
        }
    })
}
