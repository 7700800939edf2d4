-- Phase 1 of two-phase: pending -> processing with a fresh lease.
UPDATE pgonce.jobs
SET status = 'processing',
    lease_token = gen_random_uuid(),
    lease_expires_at = now() + make_interval(secs => $2),
    claimed_at = now()
WHERE id = $1
  AND status = 'pending'
  AND run_at <= now()
RETURNING lease_token, lease_expires_at
