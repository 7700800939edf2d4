-- $1 lock_timeout (milliseconds, or a value lock_timeout_get.sql read),
-- local to the current transaction or savepoint.
SELECT set_config('lock_timeout', $1, true)
