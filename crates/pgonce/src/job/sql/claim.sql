-- Phase 1 of two-phase: pending -> processing with a fresh lease; when the
-- claim loses, the job's state as the winner left it (see migration 0080).
SELECT claimed_token, claimed_until, found_status, found_run_at, found_lease_until
FROM pgonce.job_claim($1, $2)
