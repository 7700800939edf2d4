-- Extends a lease that is still the current one, from this statement's
-- start (not its transaction's: migration 0190). Matching nothing, it asks
-- pgonce.fence_lost whether the caller's snapshot merely predates the
-- claim ($4): then 40001; otherwise no row, the lease is lost (see
-- complete.sql).
WITH extended AS (
    UPDATE pgonce.jobs
    SET lease_expires_at = statement_timestamp() + make_interval(secs => $3)
    WHERE id = $1
      AND status = 'processing'
      AND lease_token = $2
    RETURNING lease_expires_at
)
SELECT lease_expires_at FROM extended
UNION ALL
SELECT NULL WHERE CASE WHEN EXISTS (SELECT FROM extended) THEN false
    ELSE pgonce.fence_lost($4, 'the lease on job ' || $1) END
