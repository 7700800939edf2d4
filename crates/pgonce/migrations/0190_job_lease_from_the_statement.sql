-- A lease runs from the statement that takes or extends it, not from the
-- start of its transaction.
--
-- `now()` is the time the transaction began. A claim or a heartbeat run in
-- a caller's transaction that had been open for a while (a worker that
-- heartbeats inside the transaction doing its work) set the lease's end
-- that much too early: a 30 s heartbeat in a transaction open for 40 s
-- wrote an end already past, and once it committed the reaper took the job
-- from a worker still running it. `statement_timestamp()` is when the
-- statement calling this function began: the same as `now()` in an
-- autocommitted call. claim_batch.sql and heartbeat.sql do the same.
-- Whether the job is due (`run_at <= now()`) is unchanged.
CREATE OR REPLACE FUNCTION pgonce.job_claim(
    job_id     bigint,
    lease_secs double precision,
    OUT claimed_token     uuid,
    OUT claimed_until     timestamptz,
    OUT found_status      text,
    OUT found_run_at      timestamptz,
    OUT found_lease_until timestamptz
) RETURNS SETOF record
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    UPDATE pgonce.jobs AS j
    SET status = 'processing',
        lease_token = gen_random_uuid(),
        lease_expires_at = statement_timestamp() + make_interval(secs => lease_secs),
        claimed_at = now()
    WHERE j.id = job_claim.job_id
      AND j.status = 'pending'
      AND j.run_at <= now()
    RETURNING j.lease_token, j.lease_expires_at, j.status, j.run_at, j.lease_expires_at
    INTO claimed_token, claimed_until, found_status, found_run_at, found_lease_until;
    IF FOUND THEN
        RETURN NEXT;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT NULL::uuid, NULL::timestamptz, j.status, j.run_at, j.lease_expires_at
        FROM pgonce.jobs AS j
        WHERE j.id = job_claim.job_id;
END
$$;
