-- The JSON columns as text, read back one by one (job.rs, get): a value
-- that cannot be read back fails no more than its own field. A time past
-- what pgonce reads back (infinity, -infinity, written by hand) reads as
-- the nearest end of that range, r (see claim.sql).
SELECT id, kind, payload::text AS payload, status, attempts, max_attempts, lease_token,
       CASE WHEN lease_expires_at IS NOT NULL
           THEN least(greatest(lease_expires_at, r.earliest), r.latest) END AS lease_expires_at,
       least(greatest(run_at, r.earliest), r.latest) AS run_at,
       result::text AS result, last_error
FROM pgonce.jobs,
     (VALUES ('4714-11-24 00:00:00+00 BC'::timestamptz,
              '9999-12-31 23:59:59.999999+00'::timestamptz)) AS r (earliest, latest)
WHERE id = $1
