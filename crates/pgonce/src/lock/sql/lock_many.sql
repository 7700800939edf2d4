-- $1 is sorted ascending and free of duplicates (done in Rust). A function
-- scan over unnest yields the elements in array order and the aggregate
-- locks them one row at a time in that order, so every caller acquires
-- overlapping keys in the same order and no two can deadlock.
--
-- Waits as long as it takes (lock() runs this for its one key):
-- lock_timeout is 0 (no bound) for the locks alone, whatever the session
-- inherited (an operator's ALTER ROLE ... SET lock_timeout), and the value
-- in force before is restored after them. Each level is evaluated before the one
-- around it (OFFSET 0 keeps the planner from merging them; the locking
-- subquery refers to the level below, so it runs for that level's row,
-- after the bound is lifted). If a wait fails, the transaction is aborted
-- and its ROLLBACK restores the setting anyway.
-- isolation: the transaction's level, for a caller whose locks are only
-- correct at one (the guard's check, whose re-read follows).
SELECT set_config('lock_timeout', was, true) AS restored,
       current_setting('transaction_isolation') AS isolation
FROM (
    SELECT was,
           (SELECT count(pg_advisory_xact_lock(key))
            FROM unnest($1::bigint[]) AS key
            WHERE unbounded IS NOT NULL) AS locked
    FROM (
        SELECT current_setting('lock_timeout') AS was,
               set_config('lock_timeout', '0', true) AS unbounded
        OFFSET 0
    ) AS before_lock
    OFFSET 0
) AS after_lock
