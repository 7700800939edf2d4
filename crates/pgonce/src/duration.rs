//! Durations checked before they reach PostgreSQL or a timer, so that a
//! duration the library takes behaves as its documentation says.
//!
//! Each bound answers a way a duration would otherwise be changed without a
//! word: PostgreSQL's `interval` holds whole microseconds and rounds a
//! shorter time to zero (a lease taken for 400 ns would have run out as it
//! was taken); its `lock_timeout` is an `int` of milliseconds; and a
//! deadline computed as now plus the duration must be a time that exists.

use std::time::Duration;

use crate::error::{Error, Result};

/// The shortest lease on a job or hold on an idempotency key: a
/// millisecond, well above the microsecond PostgreSQL rounds to, and
/// already shorter than the round trip that hands the lease back.
pub(crate) const SHORTEST_LEASE: Duration = Duration::from_millis(1);

/// Refuses `d` (named `what` in the error) when it is shorter than `min` or
/// longer than `max`.
pub(crate) fn check_within(
    what: &'static str,
    d: Duration,
    min: Duration,
    max: Duration,
) -> Result<()> {
    if d < min || d > max {
        return Err(Error::invalid(
            what,
            format!("must be {} to {}, got {d:?}", human(min), human(max)),
        ));
    }
    Ok(())
}

/// `d` in the largest unit that writes it whole (`365 days`, `12 h`,
/// `1 ms`), or as `Debug` writes it.
fn human(d: Duration) -> String {
    const UNITS: [(u128, &str); 6] = [
        (86_400_000_000_000, " days"),
        (3_600_000_000_000, " h"),
        (60_000_000_000, " min"),
        (1_000_000_000, " s"),
        (1_000_000, " ms"),
        (1_000, " µs"),
    ];
    let nanos = d.as_nanos();
    match UNITS.iter().find(|(unit, _)| nanos.is_multiple_of(*unit)) {
        Some(_) if nanos == 0 => "0".to_string(),
        Some((unit, name)) => format!("{}{name}", nanos / unit),
        None => format!("{d:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_written_in_whole_units() {
        let (min, max) = (Duration::from_millis(1), Duration::from_secs(365 * 86_400));
        assert!(check_within("lease", min, min, max).is_ok());
        assert!(check_within("lease", max, min, max).is_ok());
        let Err(Error::Invalid { why, .. }) =
            check_within("lease", Duration::from_nanos(400), min, max)
        else {
            panic!("400 ns is below 1 ms");
        };
        assert_eq!(why, "must be 1 ms to 365 days, got 400ns");
        assert!(check_within("lease", Duration::MAX, min, max).is_err());
        assert_eq!(human(Duration::ZERO), "0");
        assert_eq!(human(Duration::from_secs(12 * 3600)), "12 h");
        assert_eq!(
            human(Duration::from_millis(i32::MAX as u64)),
            "2147483647 ms"
        );
    }
}
