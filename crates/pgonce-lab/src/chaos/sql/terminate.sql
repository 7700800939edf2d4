-- Ends every backend of the session tagged $1, as a crashed client or an
-- operator would; returns how many were ended.
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
FROM pg_stat_activity
WHERE application_name = $1 AND pid <> pg_backend_pid()
