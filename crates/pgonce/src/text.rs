//! Text that becomes a key of an index (a dedupe key, a job kind), checked
//! before it reaches PostgreSQL: an error there would abort the caller's
//! transaction, and whether a long value fits an index entry would depend
//! on how well it compresses.

use crate::error::{Error, Result};

/// Refuses `s` (named `what` in the error) when it is empty, longer than
/// `max_bytes` of UTF-8, or holds NUL, which PostgreSQL's text cannot.
pub(crate) fn check_key(what: &'static str, s: &str, max_bytes: usize) -> Result<()> {
    let why = if s.is_empty() {
        "must not be empty".to_string()
    } else if s.len() > max_bytes {
        format!("{} bytes, the longest is {max_bytes}", s.len())
    } else if s.contains('\0') {
        "must contain no NUL character (SQL text cannot hold it)".to_string()
    } else {
        return Ok(());
    };
    Err(Error::invalid(what, why))
}
