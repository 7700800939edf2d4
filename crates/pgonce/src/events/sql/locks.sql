-- Takes the append's advisory locks and its transaction id, in one round trip.
-- $1: keys, sorted ascending and unique (done in Rust); $2: for each key,
-- true = exclusive (a condition being checked), false = shared (an event
-- being published). pgonce.events_lock (migration 0110) takes them one at a
-- time in array order, so callers never deadlock on each other whatever mix
-- of modes they hold, and waits as long as it takes whatever lock_timeout
-- the session inherited: its own is 0 (migration 0210), the caller's
-- statements before and after keep the session's. pg_current_xact_id()
-- assigns the transaction id before any position is drawn, which the
-- catch-up horizon relies on (see subscription.rs).
SELECT pgonce.events_lock($1::bigint[], $2::bool[]) AS locked,
       pg_current_xact_id()::text AS xid
