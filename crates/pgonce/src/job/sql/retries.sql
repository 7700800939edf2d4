-- A time past what pgonce reads back (infinity, -infinity: written by
-- hand, or a dead job's finished_at written so and copied into dead_since
-- by retry_dead.sql) reads as the nearest end of that range, r (see
-- claim.sql).
SELECT id, job_id, retried_by, reason,
       least(greatest(retried_at, r.earliest), r.latest) AS retried_at,
       previous_attempts, previous_error,
       least(greatest(dead_since, r.earliest), r.latest) AS dead_since
FROM pgonce.job_retries,
     (VALUES ('4714-11-24 00:00:00+00 BC'::timestamptz,
              '9999-12-31 23:59:59.999999+00'::timestamptz)) AS r (earliest, latest)
WHERE job_id = $1
ORDER BY id
