-- Claims up to $2 runnable jobs of kind $1. SKIP LOCKED lets concurrent
-- claimers pass each other's rows instead of queueing behind them; the outer
-- UPDATE re-checks the status, so a row claimed meanwhile is not taken twice.
-- The payload comes back as text, parsed row by row (job.rs, claim_batch).
-- The lease runs from this statement's start (migration 0190); claimed_in
-- is the transaction taking it (see claim.sql).
WITH runnable AS (
    SELECT id
    FROM pgonce.jobs
    WHERE kind = $1
      AND status = 'pending'
      AND run_at <= now()
    ORDER BY run_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE pgonce.jobs AS j
SET status = 'processing',
    lease_token = gen_random_uuid(),
    lease_expires_at = statement_timestamp() + make_interval(secs => $3),
    claimed_at = now()
FROM runnable
WHERE j.id = runnable.id
  AND j.status = 'pending'
RETURNING j.id, j.kind, j.payload::text AS payload, j.attempts, j.lease_token, j.lease_expires_at,
    pg_current_xact_id()::text::bigint AS claimed_in
