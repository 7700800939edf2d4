-- BEGIN and the guard's lock in one round trip (one simple-query message).
-- {isolation} is READ COMMITTED or SERIALIZABLE, {key} the LockKey as a
-- number, {millis} the guard's lock_timeout in milliseconds (0: none): all
-- come from our code, never from input text.
--
-- The statements run as an implicit transaction block, which the final BEGIN
-- turns into the regular transaction the caller gets (PostgreSQL protocol
-- docs, "Multiple Statements in a Simple Query": statements before a BEGIN
-- are retroactively included in its transaction block). So the lock is held
-- by that transaction. If the lock statement fails (lock_timeout, a cancel),
-- the implicit block rolls back and BEGIN never runs: the connection is left
-- outside any transaction. The caller's re-read is a later statement, whose
-- snapshot (READ COMMITTED) is taken after the lock was granted.
--
-- The lock waits at most {millis} ms, or with 0 as long as it takes: the
-- guard's own bound, not whatever lock_timeout the session inherited (an
-- operator's ALTER ROLE ... SET lock_timeout). It is set locally around the
-- lock statement only; the value in force before, kept in a
-- transaction-local custom setting meanwhile, is restored after it, so the
-- caller's own statements run with the session's.
SET TRANSACTION ISOLATION LEVEL {isolation};
SELECT set_config('pgonce.guard_lock_timeout_was', current_setting('lock_timeout'), true);
SET LOCAL lock_timeout = {millis};
SELECT pg_advisory_xact_lock({key});
SELECT set_config('lock_timeout', current_setting('pgonce.guard_lock_timeout_was'), true);
BEGIN
