-- The JSON columns as text, read back one by one (job.rs, get): a value
-- that cannot be read back fails no more than its own field.
SELECT id, kind, payload::text AS payload, status, attempts, max_attempts, lease_token,
       lease_expires_at, run_at, result::text AS result, last_error
FROM pgonce.jobs
WHERE id = $1
