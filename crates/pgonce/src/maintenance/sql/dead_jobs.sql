-- Up to $2 dead jobs dead for more than $1 seconds. A dead job an operator
-- is retrying right now is locked by the retry and skipped; once retried it
-- is pending and no longer matches. Its job_retries rows go with it
-- (ON DELETE CASCADE).
WITH old AS (
    SELECT id FROM pgonce.jobs
    WHERE status = 'dead' AND finished_at < now() - make_interval(secs => $1)
    ORDER BY finished_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM pgonce.jobs AS j
USING old
WHERE j.id = old.id AND j.status = 'dead'
