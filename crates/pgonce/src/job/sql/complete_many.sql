-- Phase 2 for many jobs in one statement, each fenced by its own lease token.
-- Returns the lease each completion took, not only the job: a batch may hold
-- a stale lease beside the same job's current one, and the stale one lost.
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
