//! Timestamps a caller gives, checked before they reach PostgreSQL, so that
//! one PostgreSQL cannot store, or pgonce cannot read back, is a typed
//! refusal rather than an aborted transaction or a panic.
//!
//! `time` holds the years -9999 to 9999 in any offset. PostgreSQL's
//! `timestamptz` starts at 4714-11-24 BC (Julian day 0): an earlier one is
//! SQLSTATE 22008, which aborts the caller's transaction. sqlx decodes a
//! `timestamptz` no later than the end of 9999 in UTC (past it, its
//! decoding panics), and its encoding converts to UTC first, which panics
//! for a time still in 9999 in its own offset but in 10000 in UTC.

use time::OffsetDateTime;

use crate::error::{Error, Result};

/// Refuses `t` (named `what` in the error) when PostgreSQL cannot store it
/// or it could not be read back: before 4714-11-24 BC or after 9999 in
/// UTC.
pub(crate) fn check_storable(what: &'static str, t: OffsetDateTime) -> Result<()> {
    match t.checked_to_utc() {
        Some(utc) if utc.date().to_julian_day() >= 0 && utc.year() <= 9999 => Ok(()),
        _ => Err(Error::invalid(
            what,
            format!("must be from 4714-11-24 BC to the end of 9999 in UTC, got {t}"),
        )),
    }
}
