-- A lease claim.sql took for a caller that stopped waiting for it (its call
-- dropped once the statement was sent, which the server runs regardless):
-- nobody has the token, so nobody works on the job. It goes back to
-- pending, runnable at once as it was when claimed (its run_at had passed),
-- without counting an attempt, since none was made. A claim that took an
-- expired lease over counted that lease's attempt, which stays counted.
-- Fenced by the token: no row when the lease is no longer the job's.
UPDATE pgonce.jobs
SET status = 'pending',
    lease_token = NULL,
    lease_expires_at = NULL
WHERE id = $1
  AND status = 'processing'
  AND lease_token = $2
RETURNING id
