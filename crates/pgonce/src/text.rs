//! Text that becomes a key of an index (a dedupe key, a job kind, a
//! sequence's scope), checked before it reaches PostgreSQL: an error there
//! would abort the caller's transaction, and whether a long value fits an
//! index entry would depend on how well it compresses.

use crate::error::{Error, Result};

/// Refuses `s` (named `what` in the error) when it is empty, longer than
/// `max_bytes` of UTF-8, or holds NUL, which PostgreSQL's text cannot.
pub(crate) fn check_key(what: &'static str, s: &str, max_bytes: usize) -> Result<()> {
    if s.is_empty() {
        return Err(Error::invalid(what, "must not be empty"));
    }
    check_text(what, s, max_bytes)
}

/// [`check_key`] for text that may be empty (the empty string is stored,
/// indexed and read back like any other): refuses `s` when it is longer
/// than `max_bytes` of UTF-8, or holds NUL.
pub(crate) fn check_text(what: &'static str, s: &str, max_bytes: usize) -> Result<()> {
    let why = if s.len() > max_bytes {
        format!("{} bytes, the longest is {max_bytes}", s.len())
    } else if s.contains('\0') {
        "must contain no NUL character (SQL text cannot hold it)".to_string()
    } else {
        return Ok(());
    };
    Err(Error::invalid(what, why))
}
