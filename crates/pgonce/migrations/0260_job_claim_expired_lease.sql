-- A claim takes over a lease that ran out, as the reaper would have
-- returned the job, without waiting for the reaper's next pass.
--
-- A claimer that died leaves its job processing until its lease runs out
-- and the reaper passes. A delivery of the job's kept message in between
-- was told JobBusy with a not_before already past: the worker hid the
-- message a second, and each return counted as a receive, towards the
-- dead-letter queue, for as long as the reaper's interval (configurable,
-- minutes in some deployments). Sent there, the message was gone, and the
-- job, once reaped to pending, had none to drive it.
--
-- The claim now does what the reaper would, in the same statement that
-- claims: the expired attempt is counted (attempts + 1, stopping at the
-- largest integer, as in reap.sql), last_error says the lease expired, and
-- the job is processing under a fresh lease; the old lease is lost. On the
-- job's last attempt the reaper makes it dead, and the claim leaves that
-- to it (JobBusy, as before): the job ends dead whatever the message does,
-- and a claim that wrote while answering no lease would make a second
-- delivery racing it wait for nothing it could take. The row lock orders a claim
-- and a reaper pass on one job: the pass skips a row the claim holds; a
-- claim meeting the pass's lock waits, then re-checks the row as the pass
-- left it. A holder's heartbeat and the claim take turns the same way: a
-- lease extended first is live again, and the claim is JobBusy. The body
-- repeats 0240's but for the expired-lease branch.
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
        claimed_at = now(),
        attempts = CASE WHEN j.status = 'processing'
            THEN least(j.attempts, 2147483646) + 1 ELSE j.attempts END,
        last_error = CASE WHEN j.status = 'processing'
            THEN 'lease expired (claimed at ' || j.claimed_at || ')' ELSE j.last_error END
    WHERE j.id = job_claim.job_id
      AND ((j.status IN ('pending', 'failed') AND j.run_at <= now())
           OR (j.status = 'processing' AND j.lease_expires_at < now()
               AND j.attempts < j.max_attempts - 1))
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
