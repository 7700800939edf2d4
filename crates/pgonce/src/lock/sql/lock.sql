-- Held until the surrounding transaction commits or rolls back.
SELECT pg_advisory_xact_lock($1)
