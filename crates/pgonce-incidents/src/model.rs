//! The domain: organizations, entities, policies and their rules,
//! observations, incidents and their lifecycle. Plain data, validated on the
//! way in; no SQL here.

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use time::OffsetDateTime;

use crate::error::{Error, Result};

/// Longest name, external id, actor or key we accept, in characters
/// (Unicode scalar values): what PostgreSQL's `length()` in the tables'
/// CHECKs and JSON Schema's `maxLength` count.
pub const MAX_NAME: usize = 200;
/// Longest incident title, in characters.
pub const MAX_TITLE: usize = 1000;

/// The pattern of a name, actor or key ([`check_name`]), for the OpenAPI
/// document: no C0 or C1 control character nor DEL (`char::is_control`).
pub const NAME_PATTERN: &str = r"^[^\u0000-\u001F\u007F-\u009F]*$";

/// The pattern of a title ([`check_title`]): no control character, and at
/// least one character that is neither a control nor Unicode White_Space
/// (`char::is_whitespace`, listed out: regular-expression dialects differ
/// on what `\s` means).
pub const TITLE_PATTERN: &str = r"^[^\u0000-\u001F\u007F-\u009F]*[^\u0000-\u0020\u007F-\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000][^\u0000-\u001F\u007F-\u009F]*$";

/// The pattern of a string that holds no NUL, which `jsonb` refuses.
pub const NO_NUL_PATTERN: &str = r"^[^\u0000]*$";

/// The schema of entity and observation attributes, for the OpenAPI
/// document: what [`check_attributes`] takes, a JSON object whose keys and
/// strings, at any depth, hold no NUL, nested at most
/// [`MAX_ATTRIBUTES_NESTING`] deep and printing in at most
/// [`max_printed_attributes`] bytes (which JSON Schema cannot state but in
/// words).
pub struct AttributesSchema;

impl JsonSchema for AttributesSchema {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Attributes".into()
    }

    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let value = g.subschema_for::<AttributeValueSchema>();
        schemars::json_schema!({
            "type": "object",
            "propertyNames": {"pattern": NO_NUL_PATTERN},
            "additionalProperties": value,
            "description": format!(
                "arrays and objects nest at most {MAX_ATTRIBUTES_NESTING} deep, this object \
                 included; printed as PostgreSQL prints it back (each number in full, without \
                 an exponent: 1e308 as 309 digits), the object takes at most \
                 {PRINTED_ATTRIBUTES_ALLOWANCE} bytes, or {PRINTED_ATTRIBUTES_PER_COMPACT_BYTE} \
                 times its compact JSON text, whichever is more"
            ),
        })
    }
}

/// Any JSON value whose keys and strings hold no NUL ([`AttributesSchema`]).
pub struct AttributeValueSchema;

impl JsonSchema for AttributeValueSchema {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "AttributeValue".into()
    }

    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let value = g.subschema_for::<AttributeValueSchema>();
        schemars::json_schema!({
            "anyOf": [
                {"type": ["null", "boolean", "number"]},
                {"type": "string", "pattern": NO_NUL_PATTERN},
                {"type": "array", "items": value},
                {"type": "object", "propertyNames": {"pattern": NO_NUL_PATTERN}, "additionalProperties": value},
            ]
        })
    }
}

/// Deserializes an integer that JSON may spell as a number with a zero
/// fraction (`38.0`): JSON Schema's `integer`, which the OpenAPI document
/// states, is any number without a fractional part, so such a value is
/// valid input. Anything else, or out of `T`'s range, is a data error.
pub fn integral<'de, D, T>(deserializer: D) -> std::result::Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64>,
{
    use serde::de::Error as _;
    let n = serde_json::Number::deserialize(deserializer)?;
    let whole = match (n.as_i64(), n.as_f64()) {
        (Some(i), _) => Some(i),
        // i64::MAX as f64 rounds up to 2^63, which is out of range.
        (None, Some(f)) if f.fract() == 0.0 && f >= i64::MIN as f64 && f < i64::MAX as f64 => {
            Some(f as i64)
        }
        _ => None,
    };
    let whole = whole.ok_or_else(|| D::Error::custom(format!("expected an integer, got {n}")))?;
    T::try_from(whole).map_err(|_| D::Error::custom(format!("integer {whole} out of range")))
}

/// Checks a short identifier-like string: 1..=[`MAX_NAME`] characters, no
/// NUL and no control characters (they end up in logs and headers).
pub fn check_name(what: &'static str, s: &str) -> Result<()> {
    if s.is_empty() || s.chars().count() > MAX_NAME {
        return Err(Error::invalid(
            what,
            format!("must be 1 to {MAX_NAME} characters"),
        ));
    }
    if s.chars().any(char::is_control) {
        return Err(Error::invalid(what, "must not contain control characters"));
    }
    Ok(())
}

/// Checks an incident title: 1..=[`MAX_TITLE`] characters, no control
/// character, not only white space.
pub fn check_title(s: &str) -> Result<()> {
    if s.chars().count() > MAX_TITLE || s.chars().all(char::is_whitespace) {
        return Err(Error::invalid(
            "title",
            format!("must be 1 to {MAX_TITLE} characters, not only white space"),
        ));
    }
    // PostgreSQL text cannot hold NUL, and controls end up in logs: refuse
    // them here, as invalid input, rather than as a database error.
    if s.chars().any(char::is_control) {
        return Err(Error::invalid(
            "title",
            "must not contain control characters",
        ));
    }
    Ok(())
}

/// Whether the number `n` reads back equal from PostgreSQL's `jsonb`, which
/// stores it as an exact `numeric` and prints it without an exponent
/// (`1.7976931348623157e308` comes back as 309 digits): an integer within
/// the 64-bit ranges, kept as one, or a finite double.
///
/// A double is written as its shortest round-trip decimal (serde_json's,
/// ryu's), which `numeric` keeps exactly and prints in full; serde_json's
/// exact float parsing (its `float_roundtrip` feature, which the workspace
/// turns on) reads that decimal back as the double nearest to it, the one
/// it was written from. So every finite double reads back equal, and
/// constant work tells whether `n` is one. Printing `n` in full and reading
/// it back, the definition this stands for, cost a string of up to 330
/// characters and serde_json's slow path for long digit strings for each
/// number: over 15 times the parse of `1e308` itself. The unit tests check
/// that the two agree on random doubles and on the edges (subnormals,
/// `-0.0`, the largest finite, integers past 2^53 and the 64-bit ranges).
pub fn number_round_trips(n: &serde_json::Number) -> bool {
    n.is_i64() || n.is_u64() || n.as_f64().is_some_and(f64::is_finite)
}

fn numbers_round_trip(v: &Value) -> bool {
    match v {
        Value::Number(n) => number_round_trips(n),
        Value::Array(items) => items.iter().all(numbers_round_trip),
        Value::Object(map) => map.values().all(numbers_round_trip),
        Value::Null | Value::Bool(_) | Value::String(_) => true,
    }
}

/// How deep arrays and objects may nest in an entity's or observation's
/// attributes, their own object included: as deep as every answer that
/// carries them can be read by serde_json, and by JSON readers with the
/// same bound, which stop at the 128th level
/// ([`pgonce::json::MAX_JSON_NESTING`] levels are read). The deepest such
/// answer, the entity listing, holds them three levels down
/// (`{"entities": [{"attributes": ...}]}`).
pub const MAX_ATTRIBUTES_NESTING: usize = pgonce::json::MAX_JSON_NESTING - 3;

/// How deep arrays and objects nest in `value`: 0 for a scalar, 1 for
/// `[1]` or `{"k": 1}`. Recursive: called on values serde_json parsed,
/// which are at most [`pgonce::json::MAX_JSON_NESTING`] deep.
fn nesting(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(nesting).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(nesting).max().unwrap_or(0),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => 0,
    }
}

/// The most bytes an entity's or observation's attributes may print as
/// ([`max_printed_attributes`]) whatever their compact JSON: 64 KiB, the
/// default `api.body_limit`. About 200 numbers of `1e308` print in it.
pub const PRINTED_ATTRIBUTES_ALLOWANCE: usize = 64 * 1024;

/// How many bytes attributes may print as for each byte of their compact
/// JSON, past [`PRINTED_ATTRIBUTES_ALLOWANCE`] ([`max_printed_attributes`]).
pub const PRINTED_ATTRIBUTES_PER_COMPACT_BYTE: usize = 2;

/// The most bytes attributes whose compact JSON text (serde_json's, about
/// the least a client sends for them) takes `compact` bytes may print as,
/// as PostgreSQL prints them ([`pgonce::json::TextLengths::printed`]):
/// [`PRINTED_ATTRIBUTES_ALLOWANCE`] or [`PRINTED_ATTRIBUTES_PER_COMPACT_BYTE`]
/// times `compact`, whichever is more.
///
/// Every read of an entity (its answer, the entity listing, the
/// pipeline's record of an observation) receives its attributes from the
/// database as `jsonb` prints them, and parses them. `jsonb` keeps a
/// number as a `numeric`, a few bytes stored, printed in full: `1e308`,
/// sent in 5 bytes, is read back as 309 digits. Unbounded, a body at the
/// largest `api.body_limit` ([`crate::api::MAX_BODY_LIMIT`], 16 MiB) full
/// of them was read back as about 870 MB, on every read. Why this bound:
/// - a bound on the printed size alone would have to take what the
///   largest honest body prints (16 MiB of strings prints as 16 MiB and
///   more), so it would let a body at the default limit print 256 times
///   its size;
/// - a cap on each number's printed digits would refuse honest numbers
///   (`6.62607015e-34` prints as 44 characters) and still let a body of
///   numbers just under the cap print several times its size;
/// - JSON prints in at most 1.5 times its compact text (a space after
///   each `,` and `:`, strings escaped alike) but for numbers written
///   with an exponent, which print longer: twice refuses only attributes
///   made mostly of numbers far from 1 (`1e308`, `1e-20`), and only when
///   they print past the allowance, under which any attributes, whatever
///   their numbers, are taken. So a read receives at most 64 KiB, or
///   twice what the attributes take as compact JSON.
pub fn max_printed_attributes(compact: usize) -> usize {
    PRINTED_ATTRIBUTES_ALLOWANCE.max(PRINTED_ATTRIBUTES_PER_COMPACT_BYTE.saturating_mul(compact))
}

/// Checks an entity's attributes: a JSON object that `jsonb` can hold and
/// pgonce can read back (no NUL in a key or string:
/// [`pgonce::json::check_storable`]), nested at most
/// [`MAX_ATTRIBUTES_NESTING`] deep, so that every answer holding them can
/// be read back, whose numbers read back equal from `jsonb`
/// ([`number_round_trips`]), and which print, as PostgreSQL prints them,
/// in at most [`max_printed_attributes`] bytes, so that no read receives
/// far more than was sent. Refused here as invalid input, so the API
/// answers 422 and the pipeline counts the message as malformed, instead
/// of a database error on every delivery, a row no read can decode, an
/// entity listing a client cannot read, or one every read of which is
/// many times the size it was sent.
pub fn check_attributes(attributes: &Value) -> Result<()> {
    if !attributes.is_object() {
        return Err(Error::invalid("attributes", "must be a JSON object"));
    }
    if nesting(attributes) > MAX_ATTRIBUTES_NESTING {
        return Err(Error::invalid(
            "attributes",
            format!(
                "arrays and objects nest at most {MAX_ATTRIBUTES_NESTING} deep, the attributes' \
                 own object included (the entity listing holds them three levels down, and \
                 JSON readers such as serde_json read at most {} levels)",
                pgonce::json::MAX_JSON_NESTING
            ),
        ));
    }
    if let Err(pgonce::Error::Invalid { why, .. }) =
        pgonce::json::check_storable("attributes", attributes)
    {
        return Err(Error::invalid("attributes", why));
    }
    if !numbers_round_trip(attributes) {
        return Err(Error::invalid(
            "attributes",
            "hold a number the database cannot store exactly",
        ));
    }
    let lengths = pgonce::json::text_lengths(attributes);
    let most = max_printed_attributes(lengths.compact);
    if lengths.printed > most {
        return Err(Error::invalid(
            "attributes",
            format!(
                "would be read back as {} bytes, as PostgreSQL prints them (each number in \
                 full, without an exponent: 1e308 as 309 digits), past the {most} they may \
                 take: {PRINTED_ATTRIBUTES_ALLOWANCE}, or {PRINTED_ATTRIBUTES_PER_COMPACT_BYTE} \
                 times their {} bytes of compact JSON, whichever is more",
                lengths.printed, lengths.compact
            ),
        ));
    }
    Ok(())
}

/// A tenant: everything else (API keys, entities, policies, incidents)
/// belongs to exactly one organization.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Organization {
    /// The organization's id.
    pub id: i64,
    /// Its name, 1 to 200 characters.
    pub name: String,
    /// When it was created (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    #[schemars(with = "String")]
    pub created_at: OffsetDateTime,
}

/// Something observed (a host, a service), created on its first observation
/// and identified within its organization by its external id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Entity {
    /// The entity's id, assigned by the service.
    pub id: i64,
    /// The organization it belongs to.
    pub organization_id: i64,
    /// The producer's id of the entity, unique within the organization
    /// (an observation's `entity`).
    pub external_id: String,
    /// The latest observation's attributes.
    #[schemars(with = "AttributesSchema")]
    pub attributes: Value,
    /// Run-time state read by [`Singleton::PerEntity`] policies.
    pub singleton_incidents: bool,
}

/// Whether a policy allows at most one OPEN incident per entity (I1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Singleton {
    /// Any number may be open.
    Never,
    /// At most one.
    Always,
    /// At most one iff the entity's `singleton_incidents` is true when the
    /// incident is written: decided at run time, so no static unique index
    /// can express it, and the guard is what keeps I1.
    PerEntity,
}

impl Singleton {
    /// The name stored in the database and used in JSON: `never`, `always`,
    /// `per_entity`.
    pub fn as_str(self) -> &'static str {
        match self {
            Singleton::Never => "never",
            Singleton::Always => "always",
            Singleton::PerEntity => "per_entity",
        }
    }
}

impl FromStr for Singleton {
    type Err = Error;
    fn from_str(s: &str) -> Result<Singleton> {
        match s {
            "never" => Ok(Singleton::Never),
            "always" => Ok(Singleton::Always),
            "per_entity" => Ok(Singleton::PerEntity),
            _ => Err(Error::invalid(
                "singleton",
                "must be never, always or per_entity",
            )),
        }
    }
}

/// A comparison of an observation's numeric attribute with a threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Violated when the attribute is greater than the value.
    Gt,
    /// Violated when the attribute is greater than or equal to the value.
    Gte,
    /// Violated when the attribute is less than the value.
    Lt,
    /// Violated when the attribute is less than or equal to the value.
    Lte,
    /// Violated when the attribute equals the value.
    Eq,
    /// Violated when the attribute differs from the value.
    Ne,
}

/// A policy's rule: violated when `attribute` of the observation compares
/// with `value` by `op`. A missing or non-numeric attribute is no violation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// The observation attribute compared, 1 to 200 characters.
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    pub attribute: String,
    /// How the attribute is compared with `value`.
    pub op: Op,
    /// The threshold; a finite number. `-0.0` is stored, and read back, as
    /// `0.0`, which every rule compares with alike.
    #[serde(deserialize_with = "exact_double")]
    pub value: f64,
}

/// A number as a double, refusing an integer a double cannot hold (past
/// 2^53, such as 9007199254740993): it would be compared, stored and read
/// back as its neighbour. The request body's own check
/// (`api::extract`) keeps such an integer exact in an attributes object,
/// where it stays an integer; here it must become a double.
///
/// An integer that is the double's shortest decimal is that double, not
/// its neighbour: `1.844674407370955e19` (exactly 18446744073709549568) is
/// stored by `jsonb` as the numeric `18446744073709550000` and printed so,
/// without exponent or fraction, and every read of a stored rule must
/// take back what was written (a policy that could not be read would fail
/// its organization's listings and every observation the pipeline handles
/// for it).
fn exact_double<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    let n = serde_json::Number::deserialize(d)?;
    let f = n
        .as_f64()
        .ok_or_else(|| serde::de::Error::custom("not a number"))?;
    let integer = n.as_i64().map(i128::from).or(n.as_u64().map(i128::from));
    match integer {
        // A cast of a finite double to i128 is exact for every double an
        // i64 or u64 can round to; Rust prints a double as its shortest
        // round-trip digits, without an exponent, like PostgreSQL's numeric.
        Some(i) if f as i128 != i && format!("{f}") != i.to_string() => Err(
            serde::de::Error::custom(format!("{n} cannot be kept exactly as a double")),
        ),
        _ => Ok(f),
    }
}

impl Rule {
    /// Checks the attribute name ([`check_name`]) and that `value` is finite and
    /// stored exactly by the database; otherwise [`Error::Invalid`].
    pub fn validate(&self) -> Result<()> {
        check_name("rule attribute", &self.attribute)?;
        let exact =
            serde_json::Number::from_f64(self.value).is_some_and(|n| number_round_trips(&n));
        if !exact {
            return Err(Error::invalid(
                "rule value",
                "must be a finite number the database stores exactly",
            ));
        }
        Ok(())
    }

    /// Whether `attributes` violate the rule.
    pub fn violated_by(&self, attributes: &Value) -> bool {
        let Some(x) = attributes.get(&self.attribute).and_then(Value::as_f64) else {
            return false;
        };
        match self.op {
            Op::Gt => x > self.value,
            Op::Gte => x >= self.value,
            Op::Lt => x < self.value,
            Op::Lte => x <= self.value,
            Op::Eq => x == self.value,
            Op::Ne => x != self.value,
        }
    }
}

/// What an organization watches for: a rule evaluated against each
/// observation, and whether the incidents it opens are singletons (I1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Policy {
    /// The policy's id.
    pub id: i64,
    /// The organization it belongs to.
    pub organization_id: i64,
    /// Its name, 1 to 200 characters; incidents it opens are titled
    /// `<name> violated on <entity>`.
    pub name: String,
    /// How many OPEN incidents it may have per entity.
    pub singleton: Singleton,
    /// The rule an observation violates to open an incident.
    pub rule: Rule,
}

/// An incident's lifecycle: OPEN -> ACKNOWLEDGED -> RESOLVED, or OPEN ->
/// RESOLVED. Each change is one conditional UPDATE (`WHERE lifecycle =
/// ANY(from)`), so two concurrent callers cannot both make it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Lifecycle {
    /// Opened, nobody has acknowledged it yet. Counts for I1.
    Open,
    /// Someone is on it. No longer counts as OPEN for I1.
    Acknowledged,
    /// Closed; final.
    Resolved,
}

impl Lifecycle {
    /// The name stored in the database and used in JSON: `OPEN`,
    /// `ACKNOWLEDGED`, `RESOLVED`.
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Open => "OPEN",
            Lifecycle::Acknowledged => "ACKNOWLEDGED",
            Lifecycle::Resolved => "RESOLVED",
        }
    }
}

impl fmt::Display for Lifecycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Lifecycle {
    type Err = Error;
    fn from_str(s: &str) -> Result<Lifecycle> {
        match s.to_ascii_uppercase().as_str() {
            "OPEN" => Ok(Lifecycle::Open),
            "ACKNOWLEDGED" => Ok(Lifecycle::Acknowledged),
            "RESOLVED" => Ok(Lifecycle::Resolved),
            _ => Err(Error::invalid(
                "lifecycle",
                "must be OPEN, ACKNOWLEDGED or RESOLVED",
            )),
        }
    }
}

/// An incident: opened by the pipeline for a policy and an entity, or declared
/// by hand, numbered per organization.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Incident {
    /// The incident's id, unique across organizations.
    pub id: i64,
    /// The organization it belongs to.
    pub organization_id: i64,
    /// The organization's number: 1, 2, 3... without gaps (I2).
    pub number: i64,
    /// The policy whose rule opened it; none for a declared incident.
    pub policy_id: Option<i64>,
    /// The entity it is about; none for a declaration that named no entity.
    pub entity_id: Option<i64>,
    /// Where it is in its lifecycle.
    pub lifecycle: Lifecycle,
    /// Its title, 1 to 1000 characters.
    pub title: String,
    /// Who opened it: `pipeline`, or the declaring actor.
    pub opened_by: String,
    /// When it was opened (RFC 3339).
    #[serde(with = "time::serde::rfc3339")]
    #[schemars(with = "String")]
    pub opened_at: OffsetDateTime,
    /// Who acknowledged it, once someone has.
    pub acknowledged_by: Option<String>,
    /// When it was acknowledged (RFC 3339), once it has been.
    #[serde(with = "time::serde::rfc3339::option")]
    #[schemars(with = "Option<String>")]
    pub acknowledged_at: Option<OffsetDateTime>,
    /// Who resolved it, once someone has.
    pub resolved_by: Option<String>,
    /// When it was resolved (RFC 3339), once it has been.
    #[serde(with = "time::serde::rfc3339::option")]
    #[schemars(with = "Option<String>")]
    pub resolved_at: Option<OffsetDateTime>,
}

/// An observation of one entity, as it travels on the queue (JSON body).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Observation {
    /// The organization the observation belongs to; an integer (JSON may spell
    /// `38` as `38.0`).
    #[serde(deserialize_with = "integral")]
    #[schemars(with = "i64")]
    pub organization_id: i64,
    /// The entity's external id; created on first sight.
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    pub entity: String,
    /// Numeric attributes the policies' rules look at.
    #[schemars(with = "AttributesSchema")]
    pub attributes: Value,
    /// The producer's id of this observation (1 to 200 characters). Sent again,
    /// however late and under whatever queue message id, it is the same
    /// observation: once the pipeline has finished with it, a resend of the
    /// same entity's observation opens nothing and does not record its
    /// attributes again (a newer observation may have replaced them), and
    /// its ledger row counts every delivery. Without one, the queue's message id is
    /// used, which a resend does not share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_NAME), pattern(NAME_PATTERN))]
    pub message_id: Option<String>,
}

impl Observation {
    /// Parses and validates a queue message body.
    pub fn parse(body: &str) -> Result<Observation> {
        let o: Observation =
            serde_json::from_str(body).map_err(|e| Error::invalid("observation", e.to_string()))?;
        o.validate()?;
        Ok(o)
    }

    /// Checks the entity, the message id and the attributes
    /// ([`check_attributes`]); otherwise [`Error::Invalid`].
    pub fn validate(&self) -> Result<()> {
        check_name("entity", &self.entity)?;
        if let Some(id) = &self.message_id {
            check_name("message_id", id)?;
        }
        check_attributes(&self.attributes)
    }

    /// The observation as a queue message's body: its JSON, which
    /// [`Observation::parse`] reads back equal, taken by every queue.
    /// Amazon SQS takes only XML's characters in a body, and serde_json
    /// escapes only the C0 controls, `"` and `\`: U+FFFE and U+FFFF, which
    /// names and attributes may hold, are written escaped (`\ufffe`), as
    /// serde_json has no option for it.
    pub fn queue_body(&self) -> String {
        struct XmlCharacters;
        impl serde_json::ser::Formatter for XmlCharacters {
            fn write_string_fragment<W: ?Sized + std::io::Write>(
                &mut self,
                writer: &mut W,
                fragment: &str,
            ) -> std::io::Result<()> {
                let mut rest = fragment;
                while let Some(at) = rest.find(['\u{FFFE}', '\u{FFFF}']) {
                    let (before, from) = rest.split_at(at);
                    writer.write_all(before.as_bytes())?;
                    let c = from.chars().next().expect("found at `at`");
                    write!(writer, "\\u{:04x}", u32::from(c))?;
                    rest = &from[c.len_utf8()..];
                }
                writer.write_all(rest.as_bytes())
            }
        }
        let mut body = Vec::new();
        self.serialize(&mut serde_json::Serializer::with_formatter(
            &mut body,
            XmlCharacters,
        ))
        .expect("an observation serializes");
        String::from_utf8(body).expect("serde_json writes UTF-8")
    }

    /// The key the pipeline records this observation under (its ledger
    /// row, its incidents' source): `producer:` and the producer's
    /// [`Observation::message_id`], else `queue:` and the queue's id of the
    /// delivery ([`queue_ledger_key`]). Each kind has its prefix, so a
    /// producer's id that spells a queue's (`"1"`, the PostgreSQL queue's
    /// first) is never taken for that delivery's resend, which would drop
    /// it unrecorded.
    pub fn ledger_key(&self, queue_message_id: &str) -> String {
        match &self.message_id {
            Some(id) => format!("producer:{id}"),
            None => queue_ledger_key(queue_message_id),
        }
    }

    /// The FIFO message group: one entity's observations are processed in
    /// order, one at a time (until a visibility timeout runs out).
    /// `<org>/<entity>`, or `<org>/sha256:<hex>` (the entity's SHA-256)
    /// when that would exceed a FIFO group id's 128 bytes (entities may
    /// have 200 characters), hold a character outside printable ASCII, or
    /// when the entity itself begins with `sha256:`, so that no entity
    /// spelt like a hashed id shares the group of the one it hashes.
    pub fn group(&self) -> String {
        scoped_id(self.organization_id, &self.entity)
    }

    /// The queue's deduplication id for a client's idempotency key, scoped
    /// to the organization: the queue deduplicates across all of them, and
    /// one organization's key must never drop another's observation. Same
    /// form as [`Observation::group`].
    pub fn dedup_id(&self, idempotency_key: &str) -> String {
        scoped_id(self.organization_id, idempotency_key)
    }
}

/// The ledger key of an observation without a producer's id, delivered
/// as the queue's message `queue_message_id` ([`Observation::ledger_key`]).
pub fn queue_ledger_key(queue_message_id: &str) -> String {
    format!("queue:{queue_message_id}")
}

/// The prefix of a hashed [`scoped_id`]'s text.
const HASHED: &str = "sha256:";

/// `<org>/<text>`, or `<org>/sha256:<hex>` when that would exceed the 128
/// bytes of a FIFO group or deduplication id (queues count bytes; a name of
/// 200 characters may take 800) or hold a character outside printable
/// ASCII, the only ones Amazon SQS takes in these ids.
///
/// A text that itself begins with `sha256:` is hashed too: sent as is, the
/// text `sha256:<hex of K>` would have the id of the long text `K`, and
/// an observation keyed so would be dropped as a resend of `K`'s (or share
/// its entity's group). So a plain id never has the hashed form and a
/// hashed one always has it; two texts share an id only by a SHA-256
/// collision. Every other text keeps the id it had before this rule.
///
/// Nothing durable holds these ids, so the rule needed no migration: a
/// group lives as long as its messages are on the queue, a deduplication
/// id for the queue's deduplication window (5 minutes on Amazon SQS), and
/// the pipeline's own ledger is keyed by the observation's message id, not
/// by either. While processes of both versions run, only texts beginning
/// with `sha256:` get two ids: a resend across the upgrade may be queued
/// twice (the ledger still catches it when it has a `message_id`), and
/// such an entity's observations may be in two groups until the older
/// ones are processed.
fn scoped_id(organization_id: i64, text: &str) -> String {
    let plain = format!("{organization_id}/{text}");
    if plain.len() <= 128
        && plain.bytes().all(|b| b.is_ascii_graphic())
        && !text.starts_with(HASHED)
    {
        return plain;
    }
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(text.as_bytes());
    format!("{organization_id}/{HASHED}{}", hex::encode(digest))
}

/// Filters and page of an incident listing. Pages are keyset pages, newest
/// number first: pass the last number seen as `before`.
///
/// An unknown parameter is refused (a misspelt filter must not silently
/// list everything).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IncidentFilter {
    /// Only incidents in this lifecycle state.
    pub lifecycle: Option<Lifecycle>,
    /// Only incidents opened by this policy.
    pub policy_id: Option<i64>,
    /// Only incidents about this entity.
    pub entity_id: Option<i64>,
    /// Only numbers below this one.
    pub before: Option<i64>,
    /// At most this many (1..=500, default 50).
    pub limit: Option<i64>,
}

impl IncidentFilter {
    /// The page size, once every filter is checked: ids and `before` are
    /// not negative, `limit` is 1 to 500.
    pub fn limit(&self) -> Result<i64> {
        for (what, value) in [
            ("policy_id", self.policy_id),
            ("entity_id", self.entity_id),
            ("before", self.before),
        ] {
            if value.is_some_and(|v| v < 0) {
                return Err(Error::invalid(what, "must not be negative"));
            }
        }
        match self.limit {
            None => Ok(50),
            Some(n) if (1..=500).contains(&n) => Ok(n),
            Some(_) => Err(Error::invalid("limit", "must be 1 to 500")),
        }
    }
}

/// A manual declaration: a person declares an incident; it gets the
/// organization's next number like any other, concurrent declarations in
/// one organization included.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Declaration {
    /// The incident's title, 1 to 1000 characters, not only white space.
    pub title: String,
    /// Optional entity (external id) the incident is about.
    #[serde(default)]
    pub entity: Option<String>,
    /// Optional idempotency key: declaring twice with one key returns the
    /// first incident.
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

impl Declaration {
    /// Checks the title ([`check_title`]), the entity and the idempotency key
    /// ([`check_name`]); otherwise [`Error::Invalid`].
    pub fn validate(&self) -> Result<()> {
        check_title(&self.title)?;
        if let Some(e) = &self.entity {
            check_name("entity", e)?;
        }
        if let Some(k) = &self.idempotency_key {
            check_name("idempotency key", k)?;
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// Doubles at the edges: subnormals, the smallest normal, the largest
    /// finite, both zeros, integers past 2^53 and the 64-bit ranges.
    const EDGE_DOUBLES: [f64; 14] = [
        5e-324,
        -5e-324,
        2.225073858507201e-308,
        f64::MIN_POSITIVE,
        1e308,
        f64::MAX,
        f64::MIN,
        0.0,
        -0.0,
        0.1,
        9007199254740994.0,
        9.223372036854776e18,
        1.8446744073709552e19,
        1e23,
    ];

    /// Checking that a double reads back equal allocates nothing, however
    /// long `jsonb` prints it (`1e308` as 309 digits): printing it so and
    /// reading that back asked the allocator for the printed text, over
    /// 300 bytes for `5e-324` and `1e308`, and cost about 15 times
    /// serde_json's parse of the number.
    #[test]
    fn a_double_is_checked_without_printing_it_in_full() {
        let mut allocating = Vec::new();
        for f in EDGE_DOUBLES {
            let n = serde_json::Number::from_f64(f).unwrap();
            let (exact, allocated) = crate::allocations::allocated_by(|| number_round_trips(&n));
            assert!(exact, "{f:e}");
            if allocated > 0 {
                allocating.push(format!("{f:e}: {allocated} bytes"));
            }
        }
        assert_eq!(allocating, Vec::<String>::new());
    }

    /// `text`, a JSON number, as PostgreSQL's `numeric` (so `jsonb`) prints
    /// it: in full, without an exponent, keeping as many decimals as the
    /// text holds once its exponent has moved the point (none for `1e308`,
    /// 324 for `5e-324`), and no sign on zero. Checked against PostgreSQL
    /// 15 on serde_json's text of 3000 random doubles.
    pub(crate) fn as_numeric_prints(text: &str) -> String {
        let parts = pgonce::json::NumberParts::of(text);
        // The value is `whole fraction` x 10^-scale.
        let scale = parts.fraction.len() as i64 - parts.exponent.parse::<i64>().unwrap();
        let mut digits = format!("{}{}", parts.whole, parts.fraction);
        if scale < 0 {
            digits.push_str(&"0".repeat(scale.unsigned_abs() as usize));
        }
        let scale = scale.max(0) as usize;
        if digits.len() <= scale {
            digits.insert_str(0, &"0".repeat(scale + 1 - digits.len()));
        }
        let (integer, decimals) = digits.split_at(digits.len() - scale);
        let integer = match integer.trim_start_matches('0') {
            "" => "0",
            integer => integer,
        };
        let zero = integer == "0" && decimals.bytes().all(|b| b == b'0');
        let sign = if parts.negative && !zero { "-" } else { "" };
        if scale == 0 {
            format!("{sign}{integer}")
        } else {
            format!("{sign}{integer}.{decimals}")
        }
    }

    /// What [`number_round_trips`] stands for: `n`, as serde_json writes it,
    /// printed by `numeric` in full and read back by serde_json, is `n`
    /// (`-0.0` and `0.0` are one number; an integral double may come back
    /// as an integer).
    fn reads_back_printed_in_full(n: &serde_json::Number) -> bool {
        let printed = as_numeric_prints(&n.to_string());
        match serde_json::from_str::<serde_json::Number>(&printed) {
            Ok(back) => back == *n || (n.is_f64() && back.as_f64() == n.as_f64()),
            Err(_) => false,
        }
    }

    /// Doubles of every kind: any bits (every exponent alike, NaN and the
    /// infinities among them), subnormals, the edges, integers of the
    /// 64-bit ranges and about 2^53.
    pub(crate) fn double() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<u64>().prop_map(f64::from_bits),
            (any::<bool>(), 0..1u64 << 52)
                .prop_map(|(negative, m)| f64::from_bits(m | u64::from(negative) << 63)),
            proptest::sample::select(EDGE_DOUBLES.to_vec()),
            any::<i64>().prop_map(|i| i as f64),
            any::<u64>().prop_map(|u| u as f64),
            (-64..64i64).prop_map(|d| (1u64 << 53) as f64 + d as f64),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The constant-work check agrees with its definition on every
        /// double serde_json can hold (none that is not finite).
        #[test]
        fn a_double_reads_back_exactly_when_the_check_says(f in double()) {
            match serde_json::Number::from_f64(f) {
                Some(n) => prop_assert_eq!(number_round_trips(&n), reads_back_printed_in_full(&n)),
                None => prop_assert!(!f.is_finite()),
            }
        }

        /// The same on numbers serde_json reads from JSON text: integers
        /// past the 64-bit ranges and long decimals become doubles.
        #[test]
        fn a_number_read_from_text_reads_back_exactly_when_the_check_says(
            text in "-?(0|[1-9][0-9]{0,40})(\\.[0-9]{1,40})?([eE][+-]?[0-9]{1,3})?"
        ) {
            if let Ok(n) = serde_json::from_str::<serde_json::Number>(&text) {
                prop_assert_eq!(number_round_trips(&n), reads_back_printed_in_full(&n), "{}", text);
            }
        }
    }

    /// `{"x": [1e308, ...]}` prints as 311 bytes a number and 7 more, its
    /// compact JSON in 6 and 7: 210 of them print within
    /// PRINTED_ATTRIBUTES_ALLOWANCE, 211 past it (and past twice their
    /// compact JSON). Strings past the allowance, printing about as sent,
    /// are taken.
    #[test]
    fn attributes_print_within_the_allowance_or_twice_their_compact_json() {
        let of = |count: usize| json!({ "x": vec![1e308; count] });
        assert_eq!(pgonce::json::text_lengths(&of(210)).printed, 210 * 311 + 7);
        assert!(check_attributes(&of(210)).is_ok());
        let Err(Error::Invalid { why, .. }) = check_attributes(&of(211)) else {
            panic!("211 of 1e308 are taken");
        };
        assert!(
            why.starts_with("would be read back as 65628 bytes, as PostgreSQL prints them"),
            "{why}"
        );
        let strings = json!({ "x": vec!["abcdef"; 100_000] });
        assert!(pgonce::json::text_lengths(&strings).printed > PRINTED_ATTRIBUTES_ALLOWANCE);
        assert!(check_attributes(&strings).is_ok());
    }

    #[test]
    fn rules_compare_numeric_attributes_only() {
        let rule = Rule {
            attribute: "cpu".into(),
            op: Op::Gt,
            value: 90.0,
        };
        assert!(rule.violated_by(&json!({"cpu": 95})));
        assert!(!rule.violated_by(&json!({"cpu": 90})));
        assert!(!rule.violated_by(&json!({"cpu": "95"})));
        assert!(!rule.violated_by(&json!({})));
    }

    #[test]
    fn malformed_observations_are_invalid() {
        for body in [
            "",
            "not json",
            "{}",
            r#"{"organization_id": 1, "entity": "", "attributes": {}}"#,
            r#"{"organization_id": 1, "entity": "a", "attributes": []}"#,
            r#"{"organization_id": 1, "entity": "a\u0000", "attributes": {}}"#,
            r#"{"organization_id": 1, "entity": "a", "attributes": {}, "extra": 1}"#,
        ] {
            assert!(
                matches!(Observation::parse(body), Err(Error::Invalid { .. })),
                "{body:?}"
            );
        }
        // Attributes that would print past their bound: the pipeline counts
        // such a message as malformed, as any other refused here.
        let huge = vec!["1e308"; 1000].join(",");
        let body =
            format!(r#"{{"organization_id": 1, "entity": "a", "attributes": {{"x": [{huge}]}}}}"#);
        assert!(
            matches!(Observation::parse(&body), Err(Error::Invalid { .. })),
            "1000 of 1e308"
        );
        let ok = Observation::parse(
            r#"{"organization_id": 1, "entity": "db-1", "attributes": {"cpu": 3}}"#,
        )
        .unwrap();
        assert_eq!(ok.group(), "1/db-1");
        let long = Observation {
            entity: "x".repeat(200),
            ..ok
        };
        assert!(long.group().len() <= 128 && long.group().starts_with("1/sha256:"));
    }

    /// A queue body is the observation's JSON, byte for byte, unless a name
    /// or string holds U+FFFE or U+FFFF, which it escapes; either way it
    /// parses back to the observation.
    #[test]
    fn queue_bodies_escape_only_what_sqs_refuses() {
        let plain = Observation {
            organization_id: 7,
            entity: "db-1 \u{e9}\u{1F600}\u{7F}".into(),
            attributes: json!({"cpu": 1.5, "note": "a\"b\\c\n"}),
            message_id: Some("m-1".into()),
        };
        assert_eq!(plain.queue_body(), serde_json::to_string(&plain).unwrap());
        let odd = Observation {
            entity: "\u{FFFE}x\u{FFFF}".into(),
            attributes: json!({"\u{FFFF}": ["\u{FFFE}"]}),
            ..plain
        };
        let body = odd.queue_body();
        assert!(!body.contains(['\u{FFFE}', '\u{FFFF}']), "{body}");
        assert!(body.contains(r#""\ufffex\uffff""#), "{body}");
        assert_eq!(Observation::parse(&body).unwrap(), odd);
    }

    /// An entity or key spelt like a hashed id (`sha256:<hex>`) does not
    /// share the id of the long one it is the hash of; short ones keep
    /// their plain ids, those that merely contain the prefix too.
    #[test]
    fn a_literal_id_in_the_hashed_form_is_not_the_hashed_id() {
        let long = Observation {
            organization_id: 1,
            entity: "x".repeat(200),
            attributes: json!({}),
            message_id: None,
        };
        let hashed = long.group();
        let literal = Observation {
            entity: hashed["1/".len()..].to_string(),
            ..long.clone()
        };
        assert_ne!(literal.group(), hashed);
        assert!(literal.group().starts_with("1/sha256:"));

        let hashed = long.dedup_id(&"k".repeat(300));
        assert!(hashed.starts_with("1/sha256:"), "{hashed}");
        assert_ne!(long.dedup_id(&hashed["1/".len()..]), hashed);

        assert_eq!(long.dedup_id("obs-1"), "1/obs-1");
        assert_eq!(long.dedup_id("x-sha256:1"), "1/x-sha256:1");
        assert_eq!(long.dedup_id("sha256"), "1/sha256");
    }
}
