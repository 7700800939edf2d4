-- A bounded wait for a lock, in one round trip (one simple-query message):
-- {key} the LockKey and {millis} the bound in milliseconds (at least 1),
-- both numbers from our code, never input text.
--
-- Inside the caller's transaction, the statements of one message run in
-- turn, and the first that fails skips the rest. The savepoint is what
-- keeps the caller's transaction usable after a timeout: the caller then
-- sends ROLLBACK TO and RELEASE (lock_timeout_undo.sql), which also undoes
-- the local lock_timeout. On success the lock statement has put the value
-- in force before back (each level of it is evaluated before the one
-- around it: OFFSET 0 keeps the planner from merging them), and RELEASE
-- keeps the lock, which belongs to the transaction, not the savepoint.
SAVEPOINT pgonce_lock_timeout;
SELECT set_config('lock_timeout', was, true) AS restored
FROM (
    SELECT was, pg_advisory_xact_lock({key}) AS locked
    FROM (
        SELECT current_setting('lock_timeout') AS was,
               set_config('lock_timeout', '{millis}', true) AS bounded
        OFFSET 0
    ) AS before_lock
    OFFSET 0
) AS after_lock;
RELEASE SAVEPOINT pgonce_lock_timeout
