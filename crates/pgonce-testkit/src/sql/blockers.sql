-- Who is the backend tagged $1 waiting for? One row per blocking backend;
-- no rows when it is not waiting on a lock (or not connected).
SELECT blocker.application_name, blocker_pid
FROM pg_stat_activity AS waiter
CROSS JOIN LATERAL unnest(pg_blocking_pids(waiter.pid)) AS blocker_pid
LEFT JOIN pg_stat_activity AS blocker ON blocker.pid = blocker_pid
WHERE waiter.application_name = $1
