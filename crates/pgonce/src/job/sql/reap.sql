-- Expired leases: back to pending (an attempt is counted), or dead past
-- max_attempts. SKIP LOCKED: a job whose worker is completing it right now is
-- left to that worker. The count stops at the largest integer, and the
-- test is on attempts >= max_attempts - 1 (max_attempts is at least 1): a
-- count set to the largest by hand overflowed attempts + 1 (22003) and
-- failed the whole pass, every pass.
WITH expired AS (
    SELECT id
    FROM pgonce.jobs
    WHERE status = 'processing'
      AND lease_expires_at < now()
    ORDER BY lease_expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE pgonce.jobs AS j
SET attempts = least(j.attempts, 2147483646) + 1,
    status = CASE WHEN j.attempts >= j.max_attempts - 1 THEN 'dead' ELSE 'pending' END,
    last_error = CASE WHEN j.attempts >= j.max_attempts - 1
        THEN 'lease expired on the last of ' || j.max_attempts || ' attempts'
        ELSE 'lease expired (claimed at ' || j.claimed_at || ')' END,
    finished_at = CASE WHEN j.attempts >= j.max_attempts - 1 THEN now() END,
    run_at = now(),
    lease_token = NULL,
    lease_expires_at = NULL
FROM expired
WHERE j.id = expired.id
  AND j.status = 'processing'
RETURNING j.id, j.status
