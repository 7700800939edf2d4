-- Failed jobs whose retry time has come become runnable again.
WITH due AS (
    SELECT id
    FROM pgonce.jobs
    WHERE status = 'failed'
      AND run_at <= now()
    ORDER BY run_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE pgonce.jobs AS j
SET status = 'pending'
FROM due
WHERE j.id = due.id
  AND j.status = 'failed'
RETURNING j.id
