//! Extractors whose rejections are JSON [`ApiError`]s (axum's defaults
//! answer in plain text): the caller's organization from its API key, the
//! admin token, JSON bodies, paths and query strings.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::MALFORMED_PREFIX;
use super::{ApiError, ApiState};
use crate::store;
use pgonce::json::{NumberParts, NumberText};

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
    reads_back_as_sent(bytes)?;
    Ok(parsed)
}

/// Refuses what in the body would not read back as sent: a name sent twice
/// in one object ([`Names`]), and a number the API cannot keep.
///
/// serde_json (without its `arbitrary_precision` feature, which would change
/// every `Value` of the workspace) parses an integer beyond the 64-bit
/// ranges, or a decimal with more digits than an `f64` holds, into the
/// nearest `f64`: `18446744073709551617` would be stored and read back as
/// `1.8446744073709552e19`, `1e-400` as `0`. The parsed value has no trace
/// of the text, so the text is read again, each number token
/// ([`number_tokens`]) of it once: it must denote the same decimal number
/// as what the API will write back for it (serde_json's shortest
/// round-trip form of the `f64`). An integer within the 64-bit ranges is
/// kept exactly; `-0` reads back as `0`, the same number.
///
/// Both passes read the body once each, so the work is linear in its
/// size: an earlier check parsed each object's and array's text again at
/// every level it nested in, up to 127 times the body.
fn reads_back_as_sent(body: &[u8]) -> Result<(), ApiError> {
    checked_reading(body, &mut 0)
}

/// [`reads_back_as_sent`], adding to `read` the bytes it hands to a parser
/// or scans: what its work is counted in.
fn checked_reading(body: &[u8], read: &mut usize) -> Result<(), ApiError> {
    *read += body.len();
    let names: Names = serde_json::from_slice(body).map_err(ApiError::from_json)?;
    if let Some(name) = names.repeated {
        // Not through serde_json's error: the body is JSON, and the answer
        // is about what it holds.
        return Err(ApiError::invalid(format!(
            "the name {name:?} is sent twice in one object"
        )));
    }
    let mut parsed = 0;
    let scanned = number_tokens(body, |text| {
        parsed += text.len();
        check_number(text)
    })?;
    *read += scanned + parsed;
    Ok(())
}

/// Refuses the number token `text` unless it reads back as sent
/// ([`reads_back_as_sent`]). No allocation: the two decimals compared are
/// read where they are, `text` and serde_json's text of the double written
/// on the stack ([`NumberText`]), so the work is a parse of `text` and a
/// look at each byte of the two; building strings for them cost several
/// times the parse.
fn check_number(text: &str) -> Result<(), ApiError> {
    use std::fmt::Write as _;
    let number: serde_json::Number = serde_json::from_str(text).map_err(ApiError::from_json)?;
    let exact = number.is_i64() || number.is_u64() || {
        let mut written = NumberText::default();
        write!(written, "{number}").is_ok()
            && decimal(text).is_some_and(|sent| decimal(written.as_str()) == Some(sent))
    };
    if exact {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "the number {text} cannot be kept exactly: it would read back as {number}"
        )))
    }
}

/// Calls `each` with the text of every number token of `json`, in order;
/// returns how many bytes it looked at (each byte once).
///
/// Hand-written, as no crate of the workspace hands out a number's text
/// without reading a container's text again at every level: serde_json
/// does only with `arbitrary_precision` (which feature unification would
/// turn on for every `Value` of the workspace) or through `RawValue`, one
/// container at a time. `json` has been parsed as JSON before, so the scan
/// relies on its grammar (RFC 8259): outside strings, a number is the only
/// token that starts with `-` or a digit, and it runs on over digits, `.`,
/// `e`, `E`, `+` and `-` only, up to a structural character or white space.
/// A string runs from `"` to the next `"` that no backslash escapes; after
/// a backslash the next byte is part of the escape (`\"`, `\\`, the `u` of
/// `\uXXXX`, whose hex digits hold no quote), and the bytes of a UTF-8
/// sequence are all above 0x7F, never a `"` or a backslash.
fn number_tokens(
    json: &[u8],
    mut each: impl FnMut(&str) -> Result<(), ApiError>,
) -> Result<usize, ApiError> {
    let mut at = 0;
    // `at` only grows, one byte at a time or past a token: each byte is
    // looked at once.
    while let Some(&byte) = json.get(at) {
        match byte {
            b'"' => {
                at += 1;
                while let Some(&inside) = json.get(at) {
                    at += if inside == b'\\' { 2 } else { 1 };
                    if inside == b'"' {
                        break;
                    }
                }
            }
            b'-' | b'0'..=b'9' => {
                let start = at;
                while json
                    .get(at)
                    .is_some_and(|b| matches!(b, b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-'))
                {
                    at += 1;
                }
                // ASCII only, so UTF-8.
                let text = std::str::from_utf8(&json[start..at]).unwrap_or_default();
                each(text)?;
            }
            _ => at += 1,
        }
    }
    // A string left open (not JSON) would step past the end.
    Ok(at.min(json.len()))
}

/// The first name sent twice in one object of a JSON value, as it reads
/// once unescaped (`"a"` and `"\u0061"` are one name), in the order of the
/// text. serde_json keeps the last of two in a map, and `jsonb` too, so a
/// client whose parser keeps the first would read back another value than
/// it sent; serde_json has no option to refuse them, hence this visitor.
/// One pass: each member's value and each item is read as `Names` in turn,
/// each object keeping its names until it ends.
#[derive(Default)]
struct Names {
    /// The first name sent twice, if one was.
    repeated: Option<String>,
}

impl<'de> serde::Deserialize<'de> for Names {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Names, D::Error> {
        d.deserialize_any(NamesVisitor)
    }
}

/// Reads a [`Names`].
struct NamesVisitor;

impl<'de> serde::de::Visitor<'de> for NamesVisitor {
    type Value = Names;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Names, E> {
        Ok(Names::default())
    }

    fn visit_i64<E>(self, _: i64) -> Result<Names, E> {
        Ok(Names::default())
    }

    fn visit_u64<E>(self, _: u64) -> Result<Names, E> {
        Ok(Names::default())
    }

    fn visit_f64<E>(self, _: f64) -> Result<Names, E> {
        Ok(Names::default())
    }

    fn visit_str<E>(self, _: &str) -> Result<Names, E> {
        Ok(Names::default())
    }

    fn visit_unit<E>(self) -> Result<Names, E> {
        Ok(Names::default())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Names, A::Error> {
        let mut names = std::collections::HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            let repeated = if names.contains(&name) {
                map.next_value::<serde::de::IgnoredAny>()?;
                Some(name)
            } else {
                names.insert(name);
                map.next_value::<Names>()?.repeated
            };
            if repeated.is_some() {
                // The rest of the object is read (serde_json wants the
                // whole of it), not checked.
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                return Ok(Names { repeated });
            }
        }
        Ok(Names::default())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Names, A::Error> {
        while let Some(item) = seq.next_element::<Names>()? {
            if item.repeated.is_some() {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                return Ok(item);
            }
        }
        Ok(Names::default())
    }
}

/// The most significant digits a double's shortest round-trip decimal
/// has.
const MAX_SHORTEST_DIGITS: usize = 17;

/// A decimal number with at most [`MAX_SHORTEST_DIGITS`] significant
/// digits, in one spelling: `-0.0120e3` is negative, digits `12`, point
/// 2, that is -0.12 x 10^2. Zero is not negative, has no digits and its
/// point at 0, whatever its sign and exponent.
#[derive(Debug, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    /// The significant digits, from the first non-zero one to the last,
    /// as ASCII; `digits[len..]` is zero bytes.
    digits: [u8; MAX_SHORTEST_DIGITS],
    len: usize,
    /// Where the point goes: the value is 0.`digits` x 10^`point`.
    point: i64,
}

/// The value of a JSON number's text ([`Decimal`]), looking at each byte
/// once. `None` for a non-zero number with an exponent beyond an `i64`
/// (serde_json refuses such a number anyway) or with more significant
/// digits than [`MAX_SHORTEST_DIGITS`]: neither is what serde_json writes
/// for a double, so neither reads back as sent.
fn decimal(text: &str) -> Option<Decimal> {
    let parts = NumberParts::of(text);
    let mut digits = [0; MAX_SHORTEST_DIGITS];
    let mut len = 0;
    let mut leading_zeros: i64 = 0;
    // Zeros after a significant digit, significant once another follows.
    let mut zeros = 0;
    for digit in parts.whole.bytes().chain(parts.fraction.bytes()) {
        if digit == b'0' {
            if len == 0 {
                leading_zeros += 1;
            } else {
                zeros += 1;
            }
            continue;
        }
        let end = len + zeros + 1;
        digits.get_mut(len..end)?.fill(b'0');
        digits[end - 1] = digit;
        len = end;
        zeros = 0;
    }
    // Zero is zero whatever its exponent (`0e99999999999999999999` too).
    if len == 0 {
        return Some(Decimal {
            negative: false,
            digits,
            len,
            point: 0,
        });
    }
    Some(Decimal {
        negative: parts.negative,
        digits,
        len,
        point: parts.point(leading_zeros)?,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{as_numeric_prints, double};

    /// What the check answers of `body`: `Ok`, or the message refusing it.
    fn verdict(body: &str) -> Result<(), String> {
        reads_back_as_sent(body.as_bytes()).map_err(|e| e.message)
    }

    /// The work of the check is linear in the body's size, however deep it
    /// nests: counted in bytes handed to a parser or scanned, at most three
    /// times the body (parsed once for names, scanned once for numbers,
    /// each number's token parsed once). Reading each object's and array's
    /// text again at every level it nests in counted about 126 times the
    /// body here.
    #[test]
    fn the_work_is_linear_in_the_size_of_the_body() {
        let numbers = vec!["1.5"; 10_000].join(",");
        for depth in [1, 10, 126] {
            let body = format!(
                "{{\"a\": {}{numbers}{}}}",
                "[".repeat(depth),
                "]".repeat(depth)
            );
            let mut read = 0;
            checked_reading(body.as_bytes(), &mut read).unwrap();
            assert!(
                read <= 3 * body.len(),
                "{depth} deep: {read} bytes read for a body of {}",
                body.len()
            );
        }
    }

    /// Numbers the API accepts, at the edges of a double's range and
    /// precision and of the 64-bit integers: each spelt in at most 24
    /// characters, which serde_json reads without a buffer of its own.
    const ACCEPTED: [&str; 16] = [
        "5e-324",
        "-5e-324",
        "2.225073858507201e-308",
        "2.2250738585072014e-308",
        "1e308",
        "-1.7976931348623157e308",
        "1e22",
        "1e23",
        "0.1",
        "1.5",
        "-0.0",
        "1e-7",
        "123",
        "9007199254740993",
        "18446744073709551615",
        "-9223372036854775808",
    ];

    /// Checking a number allocates nothing: its work is reading its own
    /// text and serde_json's text of its double (at most 24 bytes, on the
    /// stack). Building strings for the two decimals compared asked the
    /// allocator for 24 to 92 bytes a double, in up to five allocations,
    /// and cost several times the parse of the number.
    #[test]
    fn a_number_is_checked_without_allocating() {
        let mut allocating = Vec::new();
        for text in ACCEPTED {
            let (checked, allocated) = crate::allocations::allocated_by(|| check_number(text));
            assert!(checked.is_ok(), "{text}");
            if allocated > 0 {
                allocating.push(format!("{text}: {allocated} bytes"));
            }
        }
        assert_eq!(allocating, Vec::<String>::new());
    }

    /// A decimal spelt out: sign, significant digits as a string, where
    /// the point goes (as [`Decimal`], with any number of digits).
    #[derive(Debug, PartialEq, Eq)]
    struct SpeltOut {
        negative: bool,
        significant: String,
        point: i64,
    }

    /// The decimal `text` denotes, spelt out; `None` for an exponent
    /// beyond an `i64`. Zero has no sign, no digits, its point at 0.
    fn spelt_out(text: &str) -> Option<SpeltOut> {
        let parts = NumberParts::of(text);
        let all = format!("{}{}", parts.whole, parts.fraction);
        let significant = all.trim_start_matches('0');
        let leading_zeros = (all.len() - significant.len()) as i64;
        let significant = significant.trim_end_matches('0');
        Some(match significant {
            "" => SpeltOut {
                negative: false,
                significant: String::new(),
                point: 0,
            },
            _ => SpeltOut {
                negative: parts.negative,
                significant: significant.to_owned(),
                point: parts.point(leading_zeros)?,
            },
        })
    }

    /// What the API guarantees of a number token, end to end: parsed by
    /// serde_json, written, stored and printed by `jsonb` in full
    /// (`as_numeric_prints`), read again and written to the client, it
    /// denotes the decimal `text` does.
    fn reads_back_as_sent_end_to_end(text: &str) -> bool {
        let Ok(number) = serde_json::from_str::<serde_json::Number>(text) else {
            return false;
        };
        let printed = as_numeric_prints(&number.to_string());
        let Ok(back) = serde_json::from_str::<serde_json::Number>(&printed) else {
            return false;
        };
        spelt_out(text).is_some_and(|sent| spelt_out(&back.to_string()) == Some(sent))
    }

    /// What the API accepts of a number token: the body's check, then the
    /// attributes' ([`crate::model::number_round_trips`]).
    fn accepted(text: &str) -> bool {
        check_number(text).is_ok()
            && serde_json::from_str(text).is_ok_and(|n| crate::model::number_round_trips(&n))
    }

    /// Number texts of every kind: any JSON number with up to 40 digits
    /// before and after the point; each double of
    /// [`crate::model::tests::double`] as serde_json writes it, in full,
    /// with 1 to 25 significant digits, with zeros after it; integers
    /// about 2^53 and the ends of the 64-bit ranges; 1 with up to 400
    /// zeros before or after it; and the edges of a double's range.
    fn number_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let spellings =
            (double(), 0..25usize, 0..4usize).prop_filter_map("finite", |(f, digits, zeros)| {
                let n = serde_json::Number::from_f64(f)?;
                let (mantissa, exponent) = format!("{:.digits$e}", f.abs())
                    .split_once('e')
                    .map(|(m, e)| (m.to_owned(), e.to_owned()))?;
                let sign = if f.is_sign_negative() { "-" } else { "" };
                let point = if mantissa.contains('.') { "" } else { "." };
                let zeros = "0".repeat(zeros);
                Some(vec![
                    n.to_string(),
                    format!("{f}"),
                    format!("{sign}{mantissa}e{exponent}"),
                    format!("{sign}{mantissa}{point}{zeros}e{exponent}"),
                ])
            });
        let integers = prop_oneof![
            (-64..64i128).prop_map(|d| (1i128 << 53) + d),
            (-64..64i128).prop_map(|d| i128::from(i64::MIN) + d),
            (-64..64i128).prop_map(|d| i128::from(i64::MAX) + d),
            (-64..64i128).prop_map(|d| i128::from(u64::MAX) + d),
        ];
        prop_oneof![
            "-?(0|[1-9][0-9]{0,40})(\\.[0-9]{1,40})?([eE][+-]?[0-9]{1,3})?",
            spellings.prop_flat_map(proptest::sample::select),
            integers.prop_map(|i| i.to_string()),
            (0..400usize).prop_map(|zeros| format!("1{}", "0".repeat(zeros))),
            (0..400usize).prop_map(|zeros| format!("0.{}1", "0".repeat(zeros))),
            proptest::sample::select(vec![
                "5e-324",
                "4e-324",
                "3e-324",
                "2e-324",
                "2.4703282292062328e-324",
                "1e-400",
                "-0",
                "-0.0",
                "0e99999999999999999999",
                "1e308",
                "1E+308",
                "1.7976931348623157e308",
                "1.7976931348623158e308",
                "1.8e308",
                "2.2250738585072011e-308",
                "2.2250738585072014e-308",
            ])
            .prop_map(str::to_owned),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(4096))]

        /// The API accepts a number exactly when it reads back as sent, end
        /// to end: the checks, each reading the number's text once and
        /// writing nothing, agree with the definition that prints the
        /// number in full and reads it back.
        #[test]
        fn a_number_is_accepted_exactly_when_it_reads_back_as_sent(text in number_text()) {
            proptest::prop_assert_eq!(accepted(&text), reads_back_as_sent_end_to_end(&text), "{}", text);
        }
    }

    /// Only number tokens are numbers: digits in strings and names, after
    /// escaped quotes and backslashes, are not read as numbers, and every
    /// number outside strings is.
    #[test]
    fn numbers_in_strings_are_not_numbers() {
        for body in [
            r#"{"18446744073709551617": "1e-400"}"#,
            r#"{"a": "\"1e-400"}"#,
            r#"{"a": "\\", "b": "1e-400\\"}"#,
            r#"{"a": "\u00221e-400"}"#,
            r#"{"é1e-400": ["ü\"", -0, 0.1, 1E2, 12.5e-1, true, null, false]}"#,
        ] {
            assert_eq!(verdict(body), Ok(()), "{body}");
        }
        for (body, number) in [
            (r#"{"a": "\\", "b": 1e-400}"#, "1e-400"),
            (
                r#"{"a": "\"", "b": [18446744073709551617]}"#,
                "18446744073709551617",
            ),
            (
                r#"{"a\\":0.10000000000000000001}"#,
                "0.10000000000000000001",
            ),
            (
                r#"{"a": {"b": [1, {"c": 2.00000000000000000000001}]}}"#,
                "2.00000000000000000000001",
            ),
        ] {
            let refused = verdict(body).unwrap_err();
            assert!(
                refused.starts_with(&format!("the number {number} cannot be kept")),
                "{body}: {refused}"
            );
        }
    }

    /// The number tokens of `json` as serde_json reads its values, one
    /// container at a time: a number's text is a value's whole text.
    fn numbers_read_by_serde_json(json: &str) -> Vec<String> {
        let raw: &serde_json::value::RawValue = serde_json::from_str(json).unwrap();
        let text = raw.get();
        match text.as_bytes().first() {
            Some(b'{') => {
                let members: std::collections::HashMap<String, &serde_json::value::RawValue> =
                    serde_json::from_str(text).unwrap();
                members
                    .values()
                    .flat_map(|v| numbers_read_by_serde_json(v.get()))
                    .collect()
            }
            Some(b'[') => {
                let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(text).unwrap();
                items
                    .iter()
                    .flat_map(|v| numbers_read_by_serde_json(v.get()))
                    .collect()
            }
            Some(b'-' | b'0'..=b'9') => vec![text.to_owned()],
            _ => Vec::new(),
        }
    }

    /// JSON text: numbers of every form, strings with every kind of
    /// escape and digits in them, nested arrays and objects. Names within
    /// an object are distinct (their escapes, `\"` and `\\`, have one
    /// spelling each), so that no member is lost to another of its name.
    fn json_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let number = "-?(0|[1-9][0-9]{0,22})(\\.[0-9]{1,22})?([eE][+-]?[0-9]{1,3})?";
        let string = r#""([a-z0-9 .+\-éü]|\\["\\/bfnrt]|\\u00[2-7][0-9a-f]|\\u20ac)*""#;
        let name = r#""([a-z0-9 .\-]|\\["\\]){0,6}""#;
        let leaf = prop_oneof![
            number.prop_map(|n| n),
            string.prop_map(|s| s),
            Just("true".to_owned()),
            Just("null".to_owned()),
        ];
        leaf.prop_recursive(6, 64, 5, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5)
                    .prop_map(|items| format!("[{}]", items.join(", "))),
                prop::collection::btree_map(name, inner, 0..5).prop_map(|members| {
                    let members: Vec<String> =
                        members.iter().map(|(n, v)| format!("{n}:{v}")).collect();
                    format!("{{ {} }}", members.join(","))
                }),
            ]
        })
    }

    proptest::proptest! {
        /// The scan finds exactly the number tokens serde_json reads, and
        /// looks at each byte once.
        #[test]
        fn the_scan_finds_the_numbers_serde_json_reads(value in json_text()) {
            let json = format!("{{\"v\": {value}}}");
            let mut scanned = Vec::new();
            let looked_at = number_tokens(json.as_bytes(), |n| {
                scanned.push(n.to_owned());
                Ok(())
            })
            .unwrap();
            let mut read = numbers_read_by_serde_json(&json);
            scanned.sort();
            read.sort();
            proptest::prop_assert_eq!(scanned, read);
            proptest::prop_assert_eq!(looked_at, json.len());
        }
    }

    /// A name sent twice is found at any depth, once unescaped, and the
    /// same name in different objects is not sent twice.
    #[test]
    fn a_name_sent_twice_is_found_at_any_depth() {
        for (body, name) in [
            (r#"{"a": 1, "a": 2}"#, "a"),
            (r#"{"a": [[{"b": 1, "\u0062": 2}]], "c": 1}"#, "b"),
            (
                r#"{"a": {"b": {"c": 1}}, "d": [{"e": {"f": 1, "f": 2}}]}"#,
                "f",
            ),
        ] {
            assert_eq!(
                verdict(body),
                Err(format!("the name {name:?} is sent twice in one object")),
                "{body}"
            );
        }
        assert_eq!(
            verdict(r#"{"a": {"b": 1}, "c": {"b": 1}, "b": [{"b": 1}, {"b": 2}]}"#),
            Ok(())
        );
    }
}
