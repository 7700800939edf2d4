-- Phase 2: processing -> completed, fenced by the lease token: one row when
-- it did. Matching nothing, it asks pgonce.fence_lost (migration 0200)
-- whether the caller's snapshot merely predates the claim ($4, the
-- transaction that took the lease): then 40001, retry the transaction;
-- otherwise no row, the lease is lost. The second branch runs after the
-- first has read the whole UPDATE, and never returns a row.
WITH completed AS (
    UPDATE pgonce.jobs
    SET status = 'completed',
        result = $3,
        lease_token = NULL,
        lease_expires_at = NULL,
        finished_at = now()
    WHERE id = $1
      AND status = 'processing'
      AND lease_token = $2
    RETURNING id
)
SELECT id FROM completed
UNION ALL
SELECT $1 WHERE CASE WHEN EXISTS (SELECT FROM completed) THEN false
    ELSE pgonce.fence_lost($4, 'the lease on job ' || $1) END
