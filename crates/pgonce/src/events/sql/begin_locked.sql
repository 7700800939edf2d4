-- Opens an append's or a decision's transaction with its locks, in one round
-- trip (one simple-query message; there are no parameters, so the caller
-- writes the lock calls in: integer literals of the keys only).
--
-- The locks run first, in an implicit transaction block; the BEGIN at the end
-- turns that block into the explicit transaction the caller goes on with,
-- keeping what the statements before it did (PostgreSQL documents this under
-- "Multiple Statements in a Simple Query"). Putting BEGIN last means a lock
-- that fails (deadlock, statement_timeout) aborts only the implicit block: the
-- session is left idle, never inside a failed transaction.
--
-- The isolation: READ COMMITTED or SERIALIZABLE, set before any snapshot.
-- The lock list: `pg_advisory_xact_lock[_shared]('<key>'::int8)` per key, in
-- ascending key order (a SELECT list is evaluated left to right), then for
-- an append `pg_current_xact_id()`, assigning the transaction id before any
-- position is drawn (the catch-up horizon relies on it, subscription.rs).
-- The table lock: the table-lock strategy's LOCK TABLE (lock_table.sql), or
-- nothing. A READ COMMITTED statement that follows takes its snapshot after
-- every one of these locks was granted.
--
-- The locks wait as long as it takes: lock_timeout is 0 (no bound) for
-- them alone, whatever the session inherited (an operator's ALTER ROLE ...
-- SET lock_timeout), which would otherwise fail the append with a bare
-- 55P03. The value in force before, kept in a transaction-local custom
-- setting meanwhile, is restored after them, so the statements the caller
-- runs next run with the session's.
SET TRANSACTION ISOLATION LEVEL {isolation};
SELECT set_config('pgonce.events_lock_timeout_was', current_setting('lock_timeout'), true);
SET LOCAL lock_timeout = 0;
SELECT {locks};
{lock_table}
SELECT set_config('lock_timeout', current_setting('pgonce.events_lock_timeout_was'), true);
BEGIN
