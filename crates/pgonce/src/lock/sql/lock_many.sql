-- $1 is sorted ascending and free of duplicates (done in Rust). A function
-- scan over unnest yields the elements in array order and the projection
-- locks them one row at a time in that order, so every caller acquires
-- overlapping keys in the same order and no two can deadlock.
SELECT pg_advisory_xact_lock(key) FROM unnest($1::bigint[]) AS key
