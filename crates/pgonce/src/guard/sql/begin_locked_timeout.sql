-- As begin_locked.sql, waiting at most {millis} ms for the lock: a local
-- lock_timeout around the lock statement only, the previous value restored
-- after it (kept in a transaction-local custom setting meanwhile).
SET TRANSACTION ISOLATION LEVEL {isolation};
SELECT set_config('pgonce.guard_lock_timeout_was', current_setting('lock_timeout'), true);
SET LOCAL lock_timeout = {millis};
SELECT pg_advisory_xact_lock({key});
SELECT set_config('lock_timeout', current_setting('pgonce.guard_lock_timeout_was'), true);
BEGIN
