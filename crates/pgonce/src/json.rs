//! What a `jsonb` column can store and pgonce can read back.
//!
//! PostgreSQL's jsonb refuses a NUL character (`\u0000`) in a string or a
//! key, with SQLSTATE 22P05. And it stores JSON nested deeper than
//! serde_json will parse (128 levels): a row holding such a value is
//! written, then every read that decodes it fails. For an event that stops
//! every read, decision and subscription that reaches it; for a job every
//! claim that picks it; for an idempotency key every replay. So a value
//! bound for a jsonb column that pgonce reads back is checked here first,
//! and refused with [`Error::Invalid`] before the database is asked.
//!
//! Every number a value holds reads back as the same [`Value`] when the
//! value is written with [`stored`] (below).

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;
use sqlx::types::Json;

use crate::error::{Error, Result};

/// How deep arrays and objects may nest in a stored JSON value: the
/// deepest serde_json reads back (a unit test holds the two together).
pub const MAX_JSON_NESTING: usize = 127;

/// Refuses `value` (named `what` in the error) if it could not be stored or
/// could not be read back: a NUL in a string or key, or nesting deeper than
/// [`MAX_JSON_NESTING`].
pub fn check_storable(what: &'static str, value: &Value) -> Result<()> {
    let why = match unstorable(value, 0) {
        None => return Ok(()),
        Some(Unstorable::TooDeep) => format!(
            "arrays and objects nest at most {MAX_JSON_NESTING} deep \
             (deeper JSON is stored, but cannot be read back)"
        ),
        Some(Unstorable::Nul) => {
            "no NUL character in a string or key (PostgreSQL's jsonb cannot hold \\u0000)".into()
        }
    };
    Err(Error::Invalid { what, why })
}

/// `value` as the `jsonb` text that reads back equal to it: bind this,
/// not the value, for a `jsonb` parameter whose column is read back.
///
/// `jsonb` keeps a number as an exact `numeric`, with the scale it was
/// written with, and prints it back in plain digits. serde_json writes a
/// whole double of 10^16 or more with an exponent (`1e16`): stored as the
/// numeric 10000000000000000, of scale 0, it is printed, and read back,
/// as an integer, another [`Value`] than the one written. So a whole
/// double that would read back as an integer, one from `i64::MIN` to
/// below 2^64, is written here in plain digits with a zero fraction
/// (`10000000000000000.0`, Rust's shortest round-trip digits), which the
/// numeric keeps as scale 1 and prints the same way: it reads back as that
/// double. A whole double past that range is written as serde_json writes
/// it (`1e+300`): its plain digits are past every integer serde_json reads,
/// so they read back as that double anyway, and in plain digits its text
/// would be up to 309 digits long where serde_json's is a few: a batch
/// that fits PostgreSQL's 1 GB message would no longer. A double with a
/// fraction keeps it in the numeric anyway (an exponent below zero becomes
/// digits after the point), and an integer is written as one.
/// Hand-written, as a [`Serialize`] of the value that writes such doubles
/// as raw JSON text: sqlx's `Json` serializes with serde_json's default,
/// and no crate stores JSON in `jsonb` number for number. Not a serde_json
/// formatter, which would do the same: the `Box<RawValue>` bound needs
/// the text checked once more by `RawValue::from_string`, a second full
/// parse of every stored value (half the time of a large append), where
/// `to_raw_value` takes serde_json's own text as it is.
pub fn stored(value: &Value) -> Json<Box<RawValue>> {
    /// `Value`'s own serialization, but for a double
    /// [`written_with_fraction`]: its text, `{value}.0`.
    struct WholeDoublesWithFraction<'a>(&'a Value);
    impl Serialize for WholeDoublesWithFraction<'_> {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use serde::ser::{SerializeMap, SerializeSeq};
            match self.0 {
                Value::Number(n) => match n.as_f64() {
                    Some(double) if n.is_f64() && written_with_fraction(double) => {
                        // A few bytes, checked as JSON once.
                        RawValue::from_string(with_fraction(double).as_str().to_owned())
                            .expect("a whole double and `.0` are a JSON number")
                            .serialize(serializer)
                    }
                    _ => n.serialize(serializer),
                },
                Value::Array(items) => {
                    let mut seq = serializer.serialize_seq(Some(items.len()))?;
                    for item in items {
                        seq.serialize_element(&WholeDoublesWithFraction(item))?;
                    }
                    seq.end()
                }
                Value::Object(map) => {
                    let mut out = serializer.serialize_map(Some(map.len()))?;
                    for (key, item) in map {
                        out.serialize_entry(key, &WholeDoublesWithFraction(item))?;
                    }
                    out.end()
                }
                scalar => scalar.serialize(serializer),
            }
        }
    }
    Json(
        serde_json::value::to_raw_value(&WholeDoublesWithFraction(value))
            .expect("a Value serializes"),
    )
}

/// Whether [`stored`] writes the finite double `value` in plain digits
/// with a zero fraction: a whole double from `i64::MIN` to below 2^64
/// (`u64::MAX as f64` is 2^64, rounded up, the first whole double read
/// back as one).
fn written_with_fraction(value: f64) -> bool {
    value.fract() == 0.0 && (i64::MIN as f64..u64::MAX as f64).contains(&value)
}

/// The text [`stored`] writes for a double [`written_with_fraction`]: its
/// digits, as every finite whole double prints in Rust (at most 20 and a
/// sign in that range), and `.0`.
fn with_fraction(double: f64) -> NumberText {
    use std::fmt::Write as _;
    let mut text = NumberText::default();
    write!(text, "{double}.0").expect("a whole double below 2^64 and `.0` take 23 bytes at most");
    text
}

/// The lengths, in bytes, of a JSON value's text ([`text_lengths`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TextLengths {
    /// serde_json's compact text of the value (`serde_json::to_string`):
    /// about the least a client sends for it (a number can be spelt a
    /// byte shorter: `1e308` for serde_json's `1e+308`).
    pub compact: usize,
    /// The value's text as PostgreSQL prints it back (`jsonb::text`) once
    /// written with [`stored`]: what every read of the stored value
    /// receives from the database. A space follows each `,` and `:`, and a
    /// number is printed as `numeric` prints it, in full, without an
    /// exponent, keeping as many decimals as its text has once the
    /// exponent has moved the point: `1e308` as 309 digits, `5e-324` as
    /// 326 characters, `1e-7` as `0.0000001`, a whole double written
    /// with a zero fraction as its digits and `.0`, a zero without a sign.
    /// Strings are escaped alike by both (`\"`, `\\`, `\n` and the
    /// other C0 controls, the rest as they are).
    pub printed: usize,
    /// The text [`stored`] writes, what pgonce sends for the value: the
    /// compact text, but for a whole double written with a zero fraction
    /// (`10000000000000000.0` for serde_json's `1e16`). A statement whose
    /// values' stored text passes [`MAX_SENT_JSON_BYTES`] is refused for
    /// this length, before the text is written.
    pub stored: usize,
}

impl TextLengths {
    fn all(len: usize) -> TextLengths {
        TextLengths {
            compact: len,
            printed: len,
            stored: len,
        }
    }
}

/// The [`TextLengths`] of `value`, counted without writing either text,
/// in one walk: each string's bytes are looked at once, and each number's
/// printed length is derived from its digits and exponent (serde_json's
/// text of it, at most 24 bytes, on the stack), never printed in full.
/// Recursive: call it on a value at most [`MAX_JSON_NESTING`] deep (see
/// [`check_storable`]), as serde_json parses.
pub fn text_lengths(value: &Value) -> TextLengths {
    match value {
        Value::Null | Value::Bool(true) => TextLengths::all(4),
        Value::Bool(false) => TextLengths::all(5),
        Value::String(s) => TextLengths::all(quoted_len(s)),
        Value::Number(n) => number_lengths(n),
        Value::Array(items) => listed(items.iter().map(text_lengths)),
        Value::Object(map) => listed(map.iter().map(|(name, value)| {
            let name = quoted_len(name);
            let value = text_lengths(value);
            // `:` compact and stored, `: ` printed.
            TextLengths {
                compact: name + 1 + value.compact,
                printed: name + 2 + value.printed,
                stored: name + 1 + value.stored,
            }
        })),
    }
}

/// The lengths of an array or object whose elements (members) have
/// `lengths`: in brackets, separated by `,` compact and `, ` printed.
fn listed(lengths: impl Iterator<Item = TextLengths>) -> TextLengths {
    let mut total = TextLengths::all(2);
    for (i, element) in lengths.enumerate() {
        let separator = usize::from(i > 0);
        total.compact += separator + element.compact;
        total.printed += 2 * separator + element.printed;
        total.stored += separator + element.stored;
    }
    total
}

/// The length of a JSON array of `strings` as serde_json writes it
/// (`["a","b"]`), counted without writing it.
pub(crate) fn string_array_len(strings: &[String]) -> usize {
    2 + strings.len().saturating_sub(1) + strings.iter().map(|s| quoted_len(s)).sum::<usize>()
}

/// The length of `s` as a JSON string, quoted and escaped as serde_json
/// and PostgreSQL both escape it.
fn quoted_len(s: &str) -> usize {
    let escaped: usize = s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | 0x08 | 0x0C | b'\n' | b'\r' | b'\t' => 2,
            0x00..=0x1F => 6,
            _ => 1,
        })
        .sum();
    escaped + 2
}

/// The lengths of the number `n`: serde_json's text of it, and what
/// `numeric` prints for it once [`stored`]. An integer prints as written.
/// A double, as its digits before the point (at least `0`), then a point
/// and its decimals when it has any: one for a double [`stored`] writes
/// with a zero fraction; else as many as serde_json's text has once its
/// exponent moved the point. A minus sign unless it is zero.
fn number_lengths(n: &serde_json::Number) -> TextLengths {
    use std::fmt::Write as _;
    let mut on_stack = NumberText::default();
    // At most 24 bytes, unless a crate in the build turns on serde_json's
    // `arbitrary_precision`, which keeps a number's text as it was parsed,
    // however long: then the text is counted from the heap (every append
    // and enqueue counts its values, and must not panic on one).
    let on_heap;
    let text = if write!(on_stack, "{n}").is_ok() {
        on_stack.as_str()
    } else {
        on_heap = n.to_string();
        on_heap.as_str()
    };
    let compact = text.len();
    let Some(double) = n.as_f64().filter(|_| n.is_f64()) else {
        return TextLengths::all(compact);
    };
    let parts = NumberParts::of(text);
    let leading_zeros = parts
        .whole
        .bytes()
        .chain(parts.fraction.bytes())
        .take_while(|&b| b == b'0')
        .count();
    let zero = leading_zeros == parts.whole.len() + parts.fraction.len();
    // serde_json's exponent is within a double's, so the point is too.
    let point = parts.point(leading_zeros as i64).unwrap_or(0);
    let integer = if zero { 1 } else { point.max(1) as usize };
    let decimals = if written_with_fraction(double) {
        1
    } else {
        let exponent: i64 = parts.exponent.parse().unwrap_or(0);
        (parts.fraction.len() as i64 - exponent).max(0) as usize
    };
    let printed = usize::from(parts.negative && !zero)
        + integer
        + if decimals > 0 { 1 + decimals } else { 0 };
    let stored = if written_with_fraction(double) {
        with_fraction(double).as_str().len()
    } else {
        compact
    };
    TextLengths {
        compact,
        printed,
        stored,
    }
}

/// The parts of a JSON number's text: `-12.50e-3` is negative, whole
/// `12`, fraction `50`, exponent `-3`. Without a fraction, the fraction is
/// empty; without an exponent, the exponent is `0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NumberParts<'a> {
    /// Whether the text starts with `-`.
    pub negative: bool,
    /// The digits before the point.
    pub whole: &'a str,
    /// The digits after the point.
    pub fraction: &'a str,
    /// Digits, after a sign or not.
    pub exponent: &'a str,
}

impl<'a> NumberParts<'a> {
    /// The parts of `text`, which JSON's grammar spells.
    pub fn of(text: &'a str) -> NumberParts<'a> {
        let (negative, unsigned) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (mantissa, exponent) = unsigned.split_once(['e', 'E']).unwrap_or((unsigned, "0"));
        let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        NumberParts {
            negative,
            whole,
            fraction,
            exponent,
        }
    }

    /// Where the point goes once the digits of the whole and the fraction
    /// lose their `leading_zeros`: the value is 0.(the digits left) x
    /// 10^point. `None` for an exponent, or a point, beyond an `i64`.
    pub fn point(&self, leading_zeros: i64) -> Option<i64> {
        self.exponent
            .parse::<i64>()
            .ok()?
            .checked_add(self.whole.len() as i64 - leading_zeros)
    }
}

/// serde_json's text of a number (its `Display`, what it writes), on the
/// stack: a double's shortest round-trip decimal takes at most 24 bytes
/// (`-2.2250738585072014e-308`), an integer at most 20. Longer text does
/// not fit, and the write fails.
#[derive(Default)]
pub struct NumberText {
    bytes: [u8; 32],
    len: usize,
}

impl NumberText {
    /// The text written so far.
    pub fn as_str(&self) -> &str {
        // Only whole `&str`s are copied in.
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or_default()
    }
}

impl std::fmt::Write for NumberText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        let room = self.bytes.get_mut(self.len..end).ok_or(std::fmt::Error)?;
        room.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// The most JSON text, in bytes, pgonce sends PostgreSQL in one statement
/// (1 GiB less 1 MiB). PostgreSQL takes a message of at most 1 GiB less
/// 2 bytes, and past it drops the connection without an error: the
/// client sees it reset. The MiB is left for the statement's other
/// parameters. Text this long could not be read back either: PostgreSQL
/// prints a value into a string of at most 1 GiB.
pub const MAX_SENT_JSON_BYTES: usize = (1 << 30) - (1 << 20);

/// Refuses, with [`Error::Invalid`] naming `what`, JSON text of `bytes`
/// bytes in all for one statement when it passes [`MAX_SENT_JSON_BYTES`].
pub(crate) fn check_sendable(what: &'static str, bytes: usize) -> Result<()> {
    if bytes <= MAX_SENT_JSON_BYTES {
        return Ok(());
    }
    Err(Error::Invalid {
        what,
        why: format!(
            "its JSON text is {bytes} bytes, past the {MAX_SENT_JSON_BYTES} one statement \
             sends PostgreSQL (which takes a message of at most 1 GiB): split the batch, \
             or store less"
        ),
    })
}

/// [`check_sendable`] for a statement that sends, beside `bytes` of JSON
/// text, `beside` bytes of other values that grow with it (the ids and
/// lengths that go with each element of an array of results): refused
/// with [`Error::Invalid`] naming `what` when both together pass
/// [`MAX_SENT_JSON_BYTES`]. The MiB it leaves is for a statement's fixed
/// parameters, not for ones that grow with a batch.
pub(crate) fn check_sendable_beside(what: &'static str, bytes: usize, beside: usize) -> Result<()> {
    if bytes.saturating_add(beside) <= MAX_SENT_JSON_BYTES {
        return Ok(());
    }
    Err(Error::Invalid {
        what,
        why: format!(
            "its JSON text is {bytes} bytes, and {beside} more go with it, past the \
             {MAX_SENT_JSON_BYTES} one statement sends PostgreSQL (which takes a message of \
             at most 1 GiB): split the batch, or store less"
        ),
    })
}

/// [`stored`], refused with [`Error::Invalid`] naming `what` when its text
/// alone is too long to send ([`check_sendable`]). Counted before it is
/// written ([`TextLengths::stored`]): a value refused for its size costs a
/// walk of it, not a GiB of text. Call it on a value [`check_storable`]
/// passed, as [`text_lengths`] requires.
pub(crate) fn stored_sendable(what: &'static str, value: &Value) -> Result<Json<Box<RawValue>>> {
    check_sendable(what, text_lengths(value).stored)?;
    Ok(stored(value))
}

/// SQLSTATE `program_limit_exceeded`: PostgreSQL's error for a value past
/// one of its size limits.
const PROGRAM_LIMIT_EXCEEDED: &str = "54000";

/// A statement's error, with a size limit of PostgreSQL's jsonb made
/// [`Error::Invalid`] (naming `what`): a string past 268,435,455 bytes, or
/// an array (an event batch, a job's results) whose elements total more.
/// Both are refused while the values are read in, before anything is
/// written. Checked by the database, not counted out beforehand: the
/// limits apply to jsonb's encoding of the values (headers, alignment,
/// numbers in its own format), which the JSON text does not measure.
pub(crate) fn too_large(what: &'static str, e: sqlx::Error) -> Error {
    match e.as_database_error() {
        Some(d) if d.code().as_deref() == Some(PROGRAM_LIMIT_EXCEEDED) => {
            // The string limit's number is in the detail, the array's in
            // the message.
            let detail = d
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .and_then(|pg| pg.detail())
                .map(|detail| format!(" {detail}"))
                .unwrap_or_default();
            Error::Invalid {
                what,
                why: format!(
                    "too large for PostgreSQL's jsonb ({}.{detail}): split it, or store less",
                    d.message()
                ),
            }
        }
        _ => e.into(),
    }
}

/// A stored JSON value pgonce cannot read back: nested deeper than
/// [`MAX_JSON_NESTING`], so written around [`check_storable`] (with raw
/// SQL). PostgreSQL returns its text all the same, kept here so an
/// operator can see, and repair, what was stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stored JSON that cannot be read back: {why}")]
#[non_exhaustive]
pub struct UnreadableJson {
    /// The value as PostgreSQL prints it (`jsonb::text`).
    pub text: String,
    /// Why it does not read back (serde_json's error).
    pub why: String,
}

/// Reads back a value from PostgreSQL's text of it (a jsonb column
/// selected as `text`, so that one unreadable value fails no more than
/// itself, never its row or its statement).
pub(crate) fn read_back(text: String) -> std::result::Result<Value, UnreadableJson> {
    serde_json::from_str(&text).map_err(|e| UnreadableJson {
        why: e.to_string(),
        text,
    })
}

/// Why a value cannot be stored and read back.
enum Unstorable {
    TooDeep,
    Nul,
}

/// The first problem in `value`, found `depth` arrays and objects down. One
/// walk (it runs on every append and enqueue), which stops at the first
/// problem and never recurses past MAX_JSON_NESTING levels, however deep
/// the value.
fn unstorable(value: &Value, depth: usize) -> Option<Unstorable> {
    match value {
        Value::String(s) => s.contains('\0').then_some(Unstorable::Nul),
        Value::Array(_) | Value::Object(_) if depth == MAX_JSON_NESTING => {
            Some(Unstorable::TooDeep)
        }
        Value::Array(items) => items.iter().find_map(|v| unstorable(v, depth + 1)),
        Value::Object(map) => map.iter().find_map(|(k, v)| {
            if k.contains('\0') {
                Some(Unstorable::Nul)
            } else {
                unstorable(v, depth + 1)
            }
        }),
        Value::Null | Value::Bool(_) | Value::Number(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How deep arrays and objects nest in `value`: 0 for a scalar, 1 for
    /// `[1]` or `{"k": 1}`.
    fn nesting(value: &Value) -> usize {
        match value {
            Value::Array(items) => 1 + items.iter().map(nesting).max().unwrap_or(0),
            Value::Object(map) => 1 + map.values().map(nesting).max().unwrap_or(0),
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => 0,
        }
    }

    fn nested(depth: usize) -> String {
        format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
    }

    /// MAX_JSON_NESTING is exactly what serde_json reads back: a value at
    /// that depth round-trips through its text, one level more does not
    /// parse, and check_storable draws the line in the same place.
    #[test]
    fn the_nesting_limit_is_the_deepest_json_that_reads_back() {
        let at_limit: Value = serde_json::from_str(&nested(MAX_JSON_NESTING)).unwrap();
        assert_eq!(nesting(&at_limit), MAX_JSON_NESTING);
        assert!(serde_json::from_str::<Value>(&nested(MAX_JSON_NESTING + 1)).is_err());
        assert!(check_storable("value", &at_limit).is_ok());

        // One level deeper, built in memory (it cannot be parsed).
        let deeper = Value::Array(vec![at_limit]);
        assert_eq!(nesting(&deeper), MAX_JSON_NESTING + 1);
        assert!(matches!(
            check_storable("value", &deeper),
            Err(Error::Invalid { .. })
        ));
        assert!(matches!(
            check_storable("value", &serde_json::json!({ "k": deeper })),
            Err(Error::Invalid { .. })
        ));
    }

    /// A whole double is written with a zero fraction, which jsonb keeps;
    /// every other number as serde_json writes it.
    #[test]
    fn whole_doubles_are_written_with_a_fraction() {
        for (value, text) in [
            (serde_json::json!(1e16), "10000000000000000.0"),
            (serde_json::json!(-2.5e18), "-2500000000000000000.0"),
            (serde_json::json!(3.0), "3.0"),
            (serde_json::json!(0.1), "0.1"),
            (serde_json::json!(1e-7), "1e-7"),
            (serde_json::json!(u64::MAX), "18446744073709551615"),
            // The ends of the whole doubles read back as integers, and the
            // first past them, written as serde_json writes them.
            (
                serde_json::json!(18446744073709549568.0),
                "18446744073709550000.0",
            ),
            (serde_json::json!(i64::MIN as f64), "-9223372036854776000.0"),
            (serde_json::json!(u64::MAX as f64), "1.8446744073709552e+19"),
            (
                serde_json::json!(-9223372036854777856.0),
                "-9.223372036854778e+18",
            ),
            (serde_json::json!(1e300), "1e+300"),
            (
                serde_json::json!({"b": [1e17]}),
                r#"{"b":[100000000000000000.0]}"#,
            ),
        ] {
            assert_eq!(stored(&value).0.get(), text);
            assert_eq!(text_lengths(&value).stored, text.len(), "{value}");
        }
    }

    /// The text [`stored`] writes, which nothing parses before it is sent,
    /// is JSON that reads back equal, keys in their order, strings
    /// escaped.
    #[test]
    fn what_is_stored_reads_back_equal() {
        let value = serde_json::json!({
            "z": "quote \" backslash \\ control \u{1} tab \t é 😀",
            "a": [1, -1, 1.5, 1e16, -0.0, null, true, {"k": [[], {}]}],
            "": u64::MAX,
        });
        let text = stored(&value).0.get().to_owned();
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, value);
        assert_eq!(
            text,
            r#"{"z":"quote \" backslash \\ control \u0001 tab \t é 😀","a":[1,-1,1.5,10000000000000000.0,-0.0,null,true,{"k":[[],{}]}],"":18446744073709551615}"#
        );
    }

    /// What PostgreSQL prints for a few values, as checked against it
    /// on thousands more (`pgonce-incidents`' `api.rs`
    /// `the_lengths_counted_are_what_serde_json_writes_and_postgresql_prints`).
    #[test]
    fn the_printed_length_is_what_jsonb_prints() {
        for (value, printed) in [
            (serde_json::json!(1e308), "1".len() + 308),
            (serde_json::json!(5e-324), "0.".len() + 323 + 1),
            (serde_json::json!(-1.5e-7), "-0.00000015".len()),
            (serde_json::json!(1e16), "10000000000000000.0".len()),
            (serde_json::json!(-0.0), "0.0".len()),
            (serde_json::json!(-12), "-12".len()),
            (serde_json::json!(0.25), "0.25".len()),
            (
                serde_json::json!({"a": [1, "x\n\u{1}\u{e9}"], "b": {}, "c": null}),
                r#"{"a": [1, "x\n\u0001é"], "b": {}, "c": null}"#.len(),
            ),
        ] {
            let lengths = text_lengths(&value);
            assert_eq!(lengths.printed, printed, "{value}");
            assert_eq!(lengths.compact, value.to_string().len(), "{value}");
            assert_eq!(lengths.stored, stored(&value).0.get().len(), "{value}");
        }
    }

    /// Text of exactly [`MAX_SENT_JSON_BYTES`] is sent, one byte more is
    /// refused, with or without bytes sent beside it.
    #[test]
    fn the_sendable_limit_is_inclusive() {
        let max = MAX_SENT_JSON_BYTES;
        assert!(check_sendable("value", max).is_ok());
        assert!(check_sendable("value", max + 1).is_err());
        assert!(check_sendable_beside("value", max - 10, 10).is_ok());
        assert!(check_sendable_beside("value", max - 10, 11).is_err());
        assert!(check_sendable_beside("value", usize::MAX, usize::MAX).is_err());
    }

    #[test]
    fn a_nul_anywhere_is_refused() {
        for bad in [
            serde_json::json!("a\0"),
            serde_json::json!(["ok", ["\0"]]),
            serde_json::json!({ "k\0": 1 }),
            serde_json::json!({ "k": { "j": "x\0y" } }),
        ] {
            assert!(
                matches!(check_storable("value", &bad), Err(Error::Invalid { .. })),
                "{bad}"
            );
        }
        assert!(check_storable("value", &serde_json::json!({ "k": ["\\0 is text"] })).is_ok());
    }
}
