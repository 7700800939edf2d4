-- Whether the backend named $1 (application_name), waiting on a lock, has
-- been running its statement longer than $2 ms; no row when it is not
-- waiting on a lock.
SELECT clock_timestamp() - query_start > make_interval(secs => $2 / 1000.0) AS waited_long
FROM pg_stat_activity
WHERE application_name = $1 AND wait_event_type = 'Lock'
