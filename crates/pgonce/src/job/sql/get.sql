SELECT id, kind, payload, status, attempts, max_attempts, lease_token, lease_expires_at,
       run_at, result, last_error
FROM pgonce.jobs
WHERE id = $1
