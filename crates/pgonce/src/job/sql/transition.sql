-- The conditional transition: it matches only while the job is still in the
-- expected state. Zero rows means another delivery already handled it.
UPDATE pgonce.jobs
SET status = $3,
    result = coalesce($4, result),
    last_error = coalesce($5, last_error),
    finished_at = CASE WHEN $3 IN ('completed', 'dead') THEN now() ELSE finished_at END
WHERE id = $1
  AND status = $2
