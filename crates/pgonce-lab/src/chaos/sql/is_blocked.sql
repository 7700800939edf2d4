-- Whether the session tagged $1 is waiting for a lock held by another
-- backend: how the driver knows a step has gone as far as it can.
SELECT EXISTS (
    SELECT 1 FROM pg_stat_activity
    WHERE application_name = $1 AND cardinality(pg_blocking_pids(pid)) > 0
)
