-- A queue send's locks on its FIFO group and deduplication id wait as long
-- as it takes, whatever lock_timeout the session inherited.
--
-- Sends to one FIFO group, and of one deduplication id, wait for each
-- other's transactions: that wait keeps a group's order its commit order
-- and a claimed id single. Under an operator's ALTER ROLE ... SET
-- lock_timeout (or a database's), the send failed after that timeout with
-- PostgreSQL's 55P03 as a bare database error. The sends (send.sql,
-- send_batch.sql) and the batches and redrives that take a set of keys
-- first (lock_groups.sql) now lock through this function, whose SET clause
-- makes lock_timeout 0 (no bound) for its locks alone and restores the
-- caller's on exit. statement_timeout still bounds every call.
--
-- keys: sorted ascending and free of duplicates (done in Rust). The
-- function scan over unnest yields them in array order and the aggregate
-- locks them one row at a time in that order, so two senders sharing keys
-- cannot deadlock. Returns how many keys it took.
CREATE FUNCTION pgonce.queue_lock_keys(keys bigint[]) RETURNS bigint
LANGUAGE sql VOLATILE
SET lock_timeout = 0
AS $$
    SELECT count(pg_advisory_xact_lock(k)) FROM unnest(keys) AS k
$$;
