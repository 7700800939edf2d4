-- The lock_timeout in force, to restore after a bounded wait.
SELECT current_setting('lock_timeout')
