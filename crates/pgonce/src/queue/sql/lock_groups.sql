-- The lock keys of FIFO groups and deduplication ids, ascending ($1), held
-- until the transaction ends: a batch with deduplication ids takes all of
-- its keys first, then sends one message at a time (each send re-takes its
-- own keys, already held), so two batches sharing groups or ids cannot
-- deadlock (postgres.rs, send_lock_keys). pgonce.queue_lock_keys (migration
-- 0220) waits as long as it takes, whatever lock_timeout the session inherited.
SELECT pgonce.queue_lock_keys($1::bigint[]) AS locked
