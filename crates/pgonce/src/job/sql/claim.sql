-- Phase 1 of two-phase: pending -> processing with a fresh lease; when the
-- claim loses, the job's state as the winner left it (see migration 0080).
-- claimed_in, the transaction taking the lease, lets the fenced writes tell
-- a snapshot older than the claim from a lost lease (migration 0200).
-- made_dead: the claim met a lease that ran out on the job's last attempt
-- and made the job dead, as the reaper would (migration 0290).
-- A time written by hand past what pgonce reads back (PostgreSQL's
-- infinity and -infinity, on which sqlx's decoding panics) reads as the
-- nearest end of that range, r: 4714-11-24 BC (PostgreSQL's first) and
-- the end of 9999 in UTC (sqlx's last). get.sql and fail.sql do the same.
SELECT claimed_token, claimed_until, found_status,
       least(greatest(found_run_at, r.earliest), r.latest) AS found_run_at,
       CASE WHEN found_lease_until IS NOT NULL
           THEN least(greatest(found_lease_until, r.earliest), r.latest) END AS found_lease_until,
       CASE WHEN claimed_token IS NOT NULL THEN pg_current_xact_id()::text::bigint END
           AS claimed_in,
       made_dead
FROM pgonce.job_claim($1, $2),
     (VALUES ('4714-11-24 00:00:00+00 BC'::timestamptz,
              '9999-12-31 23:59:59.999999+00'::timestamptz)) AS r (earliest, latest)
