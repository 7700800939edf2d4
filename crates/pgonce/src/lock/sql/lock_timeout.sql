-- A bounded wait for a lock, in one round trip (one simple-query message):
-- {key} the LockKey and {millis} the bound in milliseconds (at least 1),
-- both numbers from our code, never input text. One row: `held`, whether
-- the transaction holds the lock now, and `isolation`, its level.
--
-- The wait runs in a PL/pgSQL block with an exception handler, that is in
-- a subtransaction the server itself rolls back when the wait runs out
-- (lock_not_available): the local lock_timeout goes with it, and the
-- caller's transaction is as it was, usable, its earlier locks and writes
-- kept. Nothing is left for the client to undo, so a caller that stops
-- waiting for the answer (its future dropped mid-wait) cannot leave the
-- transaction aborted: the server finishes the message on its own. Any
-- other error (a deadlock, a cancel, statement_timeout) is not caught and
-- aborts the transaction, as it would any statement.
--
-- Granted, the lock outlives the block's subtransaction (an advisory xact
-- lock belongs to the transaction once the subtransaction commits), and
-- the value of lock_timeout in force before is put back. Then the try,
-- which never waits, tells which way the wait ended: true when granted, or
-- when the holder let go just after the wait ran out (taken then); and
-- the transaction's level, for a caller whose locks are only correct at
-- one (the guard's check, whose re-read follows).
DO $pgonce_lock_timeout$
DECLARE
    was text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '{millis}', true);
    PERFORM pg_advisory_xact_lock({key});
    PERFORM set_config('lock_timeout', was, true);
EXCEPTION WHEN lock_not_available THEN
    NULL;
END
$pgonce_lock_timeout$;
SELECT pg_try_advisory_xact_lock({key}) AS held,
       current_setting('transaction_isolation') AS isolation
