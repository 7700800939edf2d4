-- The lock keys of FIFO groups, ascending ($1), held until the transaction
-- ends: a batch with deduplication ids takes all of its groups' locks first,
-- then sends one message at a time (each send re-takes its group's lock,
-- already held), so two batches sharing groups cannot deadlock.
SELECT count(pg_advisory_xact_lock(k)) FROM unnest($1::bigint[]) AS k
