-- The lock keys of FIFO groups, ascending ($1), held until the transaction
-- ends: a redrive takes the groups of the messages it picked before it
-- moves them, ascending, so two transactions taking several groups cannot
-- deadlock (postgres.rs, redrive_batch). pgonce.queue_lock_keys (migration
-- 0220) waits as long as it takes, whatever lock_timeout the session
-- inherited.
SELECT pgonce.queue_lock_keys($1::bigint[]) AS locked
