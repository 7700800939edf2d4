-- Takes the append's advisory locks and its transaction id, in one round trip.
-- $1: keys, sorted ascending and unique (done in Rust); $2: for each key,
-- true = exclusive (a condition being checked), false = shared (an event
-- being published). unnest yields the rows in array order and the projection
-- locks them one at a time in that order, so callers never deadlock on each
-- other whatever mix of modes they hold. pg_current_xact_id() assigns the
-- transaction id before any position is drawn, which the catch-up horizon
-- relies on (see subscription.rs).
SELECT count(*) AS locks, pg_current_xact_id()::text AS xid
FROM (
    SELECT CASE WHEN exclusive
                THEN (SELECT 1 FROM pg_advisory_xact_lock(key))
                ELSE (SELECT 1 FROM pg_advisory_xact_lock_shared(key))
           END
    FROM unnest($1::bigint[], $2::bool[]) AS t(key, exclusive)
) AS taken
