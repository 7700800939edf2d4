-- Phase 1 of two-phase: pending -> processing with a fresh lease; when the
-- claim loses, the job's state as the winner left it (see migration 0080).
-- claimed_in, the transaction taking the lease, lets the fenced writes tell
-- a snapshot older than the claim from a lost lease (migration 0200).
SELECT claimed_token, claimed_until, found_status, found_run_at, found_lease_until,
       CASE WHEN claimed_token IS NOT NULL THEN pg_current_xact_id()::text::bigint END
           AS claimed_in
FROM pgonce.job_claim($1, $2)
