-- BEGIN and the guard's lock in one round trip (one simple-query message).
-- {isolation} is READ COMMITTED or SERIALIZABLE, {key} the LockKey as a
-- number: both come from our code, never from input text.
--
-- The statements run as an implicit transaction block, which the final BEGIN
-- turns into the regular transaction the caller gets (PostgreSQL protocol
-- docs, "Multiple Statements in a Simple Query": statements before a BEGIN
-- are retroactively included in its transaction block). So the lock is held
-- by that transaction. If the lock statement fails (lock_timeout, a cancel),
-- the implicit block rolls back and BEGIN never runs: the connection is left
-- outside any transaction. The caller's re-read is a later statement, whose
-- snapshot (READ COMMITTED) is taken after the lock was granted.
SET TRANSACTION ISOLATION LEVEL {isolation};
SELECT pg_advisory_xact_lock({key});
BEGIN
