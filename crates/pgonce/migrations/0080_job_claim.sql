-- A two-phase claim of one job, and when it loses, why, in one round trip.
--
-- A losing claim must tell a job that is done (completed or dead: the
-- duplicate delivery acknowledges its message) from one that is merely in
-- someone else's hands (processing, failed waiting for its retry, pending
-- but not due: the delivery keeps its message, which is what drives the job
-- again if its holder crashes and the reaper returns it).
--
-- Why a function: the state must be read after the claim's UPDATE waited
-- for a concurrent claimer, so that it is the winner's committed state.
-- A plain statement reads every table with the snapshot taken when it
-- started, before that wait. A VOLATILE function takes a fresh snapshot for
-- each statement it runs under READ COMMITTED, so the SELECT below sees what
-- the UPDATE waited for, without a second client round trip. Under
-- REPEATABLE READ or SERIALIZABLE the UPDATE of a row changed concurrently
-- raises 40001 first, as a plain UPDATE would.
--
-- One row: claimed_token and claimed_until set when the claim won;
-- otherwise NULL, and found_status, found_run_at and found_lease_until are
-- the job's state. No row: the job does not exist.
CREATE FUNCTION pgonce.job_claim(
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
        lease_expires_at = now() + make_interval(secs => lease_secs),
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
