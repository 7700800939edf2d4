-- Phase 2 for many jobs in one statement, each fenced by its own lease token.
-- Returns the lease each completion took, not only the job: a batch may hold
-- a stale lease beside the same job's current one, and the stale one lost.
-- Each lease that completed nothing asks pgonce.fence_lost (migration 0200)
-- whether the caller's snapshot merely predates its claim ($4, the
-- transactions that took the leases): then 40001 for the whole statement,
-- retry the transaction; otherwise the lease is lost and left out. The
-- second branch runs after the first has read the whole UPDATE, and never
-- returns a row.
WITH completed AS (
    UPDATE pgonce.jobs AS j
    SET status = 'completed',
        result = c.result,
        lease_token = NULL,
        lease_expires_at = NULL,
        finished_at = now()
    FROM unnest($1::bigint[], $2::uuid[], $3::jsonb[]) AS c(id, token, result)
    WHERE j.id = c.id
      AND j.status = 'processing'
      AND j.lease_token = c.token
    RETURNING j.id AS job_id, c.token
)
SELECT job_id, token FROM completed
UNION ALL
SELECT l.id, l.token
FROM unnest($1::bigint[], $2::uuid[], $4::bigint[]) AS l(id, token, claimed_in)
WHERE CASE WHEN EXISTS (SELECT FROM completed AS d WHERE d.job_id = l.id AND d.token = l.token)
    THEN false
    ELSE pgonce.fence_lost(l.claimed_in, 'the lease on job ' || l.id) END
