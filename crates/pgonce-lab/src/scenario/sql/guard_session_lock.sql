-- Session-level: held until pg_advisory_unlock or the end of the session.
SELECT pg_advisory_lock($1)
