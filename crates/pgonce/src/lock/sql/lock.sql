-- Held until the surrounding transaction commits or rolls back. Waits as
-- long as it takes: lock_timeout is 0 (no bound) for the lock alone,
-- whatever the session inherited (an operator's ALTER ROLE ... SET
-- lock_timeout), and the value in force before is restored after it. Each
-- level is evaluated before the one around it (OFFSET 0 keeps the planner
-- from merging them): the old value is read and the bound lifted, then the
-- lock is waited for, then the old value is put back. If the wait fails,
-- the transaction is aborted and its ROLLBACK restores the setting anyway.
SELECT set_config('lock_timeout', was, true) AS restored
FROM (
    SELECT was, pg_advisory_xact_lock($1) AS locked
    FROM (
        SELECT current_setting('lock_timeout') AS was,
               set_config('lock_timeout', '0', true) AS unbounded
        OFFSET 0
    ) AS before_lock
    OFFSET 0
) AS after_lock
