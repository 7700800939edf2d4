-- true when taken (held until the transaction ends); never waits.
SELECT pg_try_advisory_xact_lock($1)
