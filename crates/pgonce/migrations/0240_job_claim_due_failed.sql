-- A claim takes a failed job whose retry has come due (run_at passed), as
-- it takes a due pending one, without waiting for the re-driver.
--
-- A failed job's message is kept (AckPolicy::DeleteOnSuccess) and comes
-- back once its retry is due. The claim took only pending jobs, so until
-- the re-driver's next pass made the job pending the delivery was told
-- JobBusy with a not_before already past: the message came back again at
-- once, each return counted as a receive, and enough of them sent it to
-- the dead-letter queue while the job waited. A failed job past its run_at
-- is what the re-driver would make pending: its attempts were counted
-- when it failed, and nothing else changes on the way to pending. The
-- re-driver still makes due failed jobs pending (claim_batch pollers and
-- AckPolicy::AlwaysDelete, whose failed jobs have no message, rely on it);
-- a job claimed meanwhile is processing, which it passes over. The body
-- repeats 0190's but for the status test.
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
      AND j.status IN ('pending', 'failed')
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
