-- Extends a lease that is still the current one.
UPDATE pgonce.jobs
SET lease_expires_at = now() + make_interval(secs => $3)
WHERE id = $1
  AND status = 'processing'
  AND lease_token = $2
RETURNING lease_expires_at
