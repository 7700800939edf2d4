-- Held until the surrounding transaction commits or rolls back. Waits as
-- long as the lock_timeout in force allows: lock_timeout() sets it just
-- before, in the savepoint around this statement (lock_timeout_set.sql).
SELECT pg_advisory_xact_lock($1)
