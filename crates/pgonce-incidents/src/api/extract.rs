//! Extractors whose rejections are JSON [`ApiError`]s (axum's defaults
//! answer in plain text): the caller's organization from its API key, the
//! admin token, JSON bodies, paths and query strings.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::MALFORMED_PREFIX;
use super::{ApiError, ApiState};
use crate::store;

/// The organization whose API key (`Authorization: Bearer pgo_...`) made the
/// request. Every organization-scoped handler takes one, and passes its id
/// to every read and write: a key never reaches another organization's rows.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    /// The organization the key belongs to.
    pub organization_id: i64,
}

/// The token of the request's one `Authorization: Bearer <token>` header.
/// Sent more than once, the header is refused, whatever it holds: which
/// credentials the request is made with would be a guess (as with an
/// `Idempotency-Key` sent twice), and taking the first made a request
/// carrying one organization's key after another's in the first's.
fn bearer(parts: &Parts) -> Result<&str, ApiError> {
    let mut values = parts.headers.get_all(header::AUTHORIZATION).iter();
    let value = values
        .next()
        .ok_or(ApiError::unauthorized("missing Authorization header"))?;
    if values.next().is_some() {
        return Err(ApiError::unauthorized(
            "the Authorization header must be sent once",
        ));
    }
    let value = value
        .to_str()
        .map_err(|_| ApiError::unauthorized("malformed Authorization header"))?;
    match value.split_once(' ') {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") && !token.is_empty() => {
            Ok(token.trim())
        }
        _ => Err(ApiError::unauthorized(
            "the Authorization header must be `Bearer <key>`",
        )),
    }
}

impl FromRequestParts<ApiState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Caller, ApiError> {
        let key = bearer(parts)?;
        let organization_id = store::authenticate(state.service().pool(), key).await?;
        Ok(Caller { organization_id })
    }
}

/// A request carrying the admin token of [`super::ApiConfig::admin_token`].
/// Compared in constant time (SHA-256 digests, so the length leaks nothing
/// either). Without a configured token every admin request is refused.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequestParts<ApiState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Admin, ApiError> {
        let refused = ApiError::unauthorized("admin token required");
        let Some(expected) = state.admin_digest() else {
            return Err(ApiError::unauthorized("admin routes are disabled"));
        };
        let token = bearer(parts).map_err(|_| refused.clone())?;
        let given: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if bool::from(given.ct_eq(expected)) {
            Ok(Admin)
        } else {
            Err(refused)
        }
    }
}

/// A request body read within the body limit (else 413; a Content-Length
/// above it is refused before anything is read) and the body timeout
/// ([`super::ApiConfig::body_timeout`], else 408).
async fn read_body(req: Request, state: &ApiState) -> Result<Bytes, ApiError> {
    let limit = state.config().body_limit;
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large());
    }
    match tokio::time::timeout(state.config().body_timeout, Bytes::from_request(req, state)).await {
        Ok(read) => Ok(read?),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request body did not arrive in time",
        )),
    }
}

/// Parses a JSON body that must be an object: serde would also take an
/// array for a struct (its fields in order), which the API does not
/// document. Not JSON at all: 400; JSON but not an object: 422.
fn parse_object<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        // Syntax first: a broken body is 400 whatever it starts with.
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes).map_err(ApiError::from_json)?;
        return Err(ApiError::invalid("the body must be a JSON object"));
    }
    let parsed = serde_json::from_slice(bytes).map_err(|e| {
        let answer = ApiError::from_json(e);
        // serde_json refuses a lone surrogate escape (`"\ud800"`) in a
        // string as a syntax error, though RFC 8259's grammar allows it; its
        // `IgnoredAny` reads only the grammar (and not whether the text is
        // UTF-8, which JSON text must be). JSON that holds what no Rust
        // string can is answered like a number the API cannot keep.
        let grammatical = std::str::from_utf8(bytes).is_ok()
            && serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok();
        if answer.code == "malformed_json" && grammatical {
            ApiError::invalid(format!(
                "the body is JSON, but holds what a string cannot keep: {}",
                answer.message.trim_start_matches(MALFORMED_PREFIX)
            ))
        } else {
            answer
        }
    })?;
    // Parsed above, so valid JSON: only the numbers and the names of
    // members are left to check.
    let raw: &RawValue = serde_json::from_slice(bytes).map_err(ApiError::from_json)?;
    reads_back_as_sent(raw)?;
    Ok(parsed)
}

/// Refuses what in the body would not read back as sent: a name sent twice
/// in one object ([`Members`]), and a number the API cannot keep.
///
/// serde_json (without its `arbitrary_precision` feature, which would change
/// every `Value` of the workspace) parses an integer beyond the 64-bit
/// ranges, or a decimal with more digits than an `f64` holds, into the
/// nearest `f64`: `18446744073709551617` would be stored and read back as
/// `1.8446744073709552e19`, `1e-400` as `0`. The parsed value has no trace
/// of the text, so the text is read again: serde_json's `RawValue` hands
/// out each number's token as it was sent (no tokenizer written here), and
/// each token must denote the same decimal number as what the API will
/// write back for it (serde_json's shortest round-trip form of the
/// `f64`). An integer within the 64-bit ranges is kept exactly; `-0` reads
/// back as `0`, the same number.
fn reads_back_as_sent(raw: &RawValue) -> Result<(), ApiError> {
    let text = raw.get();
    match text.as_bytes().first() {
        Some(b'{') => {
            let members: Members = serde_json::from_str(text).map_err(ApiError::from_json)?;
            if let Some(name) = members.repeated {
                // Not through serde_json's error, whose position would count
                // from the start of this object, not of the body.
                return Err(ApiError::invalid(format!(
                    "the name {name:?} is sent twice in one object"
                )));
            }
            members.values.into_iter().try_for_each(reads_back_as_sent)
        }
        Some(b'[') => {
            let items: Vec<&RawValue> = serde_json::from_str(text).map_err(ApiError::from_json)?;
            items.into_iter().try_for_each(reads_back_as_sent)
        }
        Some(b'-' | b'0'..=b'9') => {
            let number: serde_json::Number =
                serde_json::from_str(text).map_err(ApiError::from_json)?;
            let exact = number.is_i64()
                || number.is_u64()
                || decimal(text).is_some_and(|sent| decimal(&number.to_string()) == Some(sent));
            if exact {
                Ok(())
            } else {
                Err(ApiError::invalid(format!(
                    "the number {text} cannot be kept exactly: it would read back as {number}"
                )))
            }
        }
        _ => Ok(()),
    }
}

/// The values of a JSON object's members, and the first name sent twice
/// in it (as it reads once unescaped: `"a"` and `"\u0061"` are one name).
/// serde_json keeps the last of two in a map, and `jsonb` too, so a client
/// whose parser keeps the first would read back another value than it
/// sent; serde_json has no option to refuse them, hence this visitor.
struct Members<'a> {
    /// Each member's value, up to the first name sent twice.
    values: Vec<&'a RawValue>,
    /// The first name sent twice, if one was.
    repeated: Option<String>,
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for Members<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Members<'a>, D::Error> {
        struct Visitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visitor<'a> {
            type Value = Members<'a>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members<'a>, A::Error> {
                let mut names = std::collections::HashSet::new();
                let mut values = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    if !names.insert(name.clone()) {
                        // Its value and the rest of the object are read
                        // (serde_json wants the whole of it), not checked.
                        map.next_value::<serde::de::IgnoredAny>()?;
                        while map
                            .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                            .is_some()
                        {}
                        return Ok(Members {
                            values,
                            repeated: Some(name),
                        });
                    }
                    values.push(map.next_value()?);
                }
                Ok(Members {
                    values,
                    repeated: None,
                })
            }
        }
        d.deserialize_map(Visitor(std::marker::PhantomData))
    }
}

/// The value of a JSON number's text as (negative, significant digits,
/// where the point goes): `-0.0120e3` is (true, "12", 2), that is
/// -0.12 x 10^2. Zero is (false, "", 0) whatever its sign and exponent.
/// `None` for a non-zero number with an exponent beyond an `i64` (serde_json
/// refuses such a number anyway).
fn decimal(text: &str) -> Option<(bool, String, i64)> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = unsigned.split_once(['e', 'E']).unwrap_or((unsigned, "0"));
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all = format!("{whole}{fraction}");
    let significant = all.trim_start_matches('0');
    let leading_zeros = (all.len() - significant.len()) as i64;
    let significant = significant.trim_end_matches('0');
    // Zero is zero whatever its exponent (`0e99999999999999999999` too).
    if significant.is_empty() {
        return Some((false, String::new(), 0));
    }
    let point = exponent
        .parse::<i64>()
        .ok()?
        .checked_add(whole.len() as i64 - leading_zeros)?;
    Some((negative, significant.to_string(), point))
}

/// A JSON object request body, read by `read_body`, parsed whatever the
/// Content-Type says.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<ApiState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &ApiState) -> Result<JsonBody<T>, ApiError> {
        let bytes = read_body(req, state).await?;
        parse_object(&bytes).map(JsonBody)
    }
}

/// Like [`JsonBody`], but an empty body is `None` (actions whose body is
/// optional, like acknowledging).
#[derive(Debug)]
pub struct OptionalJsonBody<T>(pub Option<T>);

impl<T: DeserializeOwned> FromRequest<ApiState> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &ApiState) -> Result<OptionalJsonBody<T>, ApiError> {
        let bytes = read_body(req, state).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJsonBody(None));
        }
        parse_object(&bytes).map(|t| OptionalJsonBody(Some(t)))
    }
}

/// Path parameters; a malformed one (`/v1/incidents/abc`) is a JSON 422.
#[derive(Debug)]
pub struct PathParams<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for PathParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(t) = Path::<T>::from_request_parts(parts, state).await?;
        Ok(PathParams(t))
    }
}

/// A query string; unknown values or wrong types are a JSON 422.
#[derive(Debug)]
pub struct QueryParams<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Query(t) = Query::<T>::from_request_parts(parts, state).await?;
        Ok(QueryParams(t))
    }
}
