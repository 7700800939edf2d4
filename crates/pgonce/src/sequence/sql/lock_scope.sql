-- advisory-lock: one transaction-level advisory lock per (table, scope),
-- released by COMMIT or ROLLBACK. $1 is the LockKey of the scope.
SELECT pg_advisory_xact_lock($1)
