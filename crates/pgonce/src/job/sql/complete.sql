-- Phase 2: processing -> completed, fenced by the lease token.
UPDATE pgonce.jobs
SET status = 'completed',
    result = $3,
    lease_token = NULL,
    lease_expires_at = NULL,
    finished_at = now()
WHERE id = $1
  AND status = 'processing'
  AND lease_token = $2
