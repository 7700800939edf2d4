-- Up to $2 completed jobs finished more than $1 seconds ago. FOR UPDATE
-- rechecks the predicate on the newest version of each row, and SKIP LOCKED
-- leaves a row someone is changing to the next pass.
WITH old AS (
    SELECT id FROM pgonce.jobs
    WHERE status = 'completed' AND finished_at < now() - make_interval(secs => $1)
    ORDER BY finished_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM pgonce.jobs AS j
USING old
WHERE j.id = old.id AND j.status = 'completed'
