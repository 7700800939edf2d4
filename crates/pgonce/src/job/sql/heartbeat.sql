-- Extends a lease that is still the current one, from this statement's
-- start (not its transaction's: migration 0190).
UPDATE pgonce.jobs
SET lease_expires_at = statement_timestamp() + make_interval(secs => $3)
WHERE id = $1
  AND status = 'processing'
  AND lease_token = $2
RETURNING lease_expires_at
