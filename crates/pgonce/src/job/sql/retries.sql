SELECT id, job_id, retried_by, reason, retried_at, previous_attempts, previous_error, dead_since
FROM pgonce.job_retries
WHERE job_id = $1
ORDER BY id
