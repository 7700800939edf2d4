-- A claim meeting a lease that ran out on the job's last attempt makes the
-- job dead, as the reaper would, and answers with that final status.
--
-- Migration 0260 left such a job to the reaper: the claim answered JobBusy
-- with a not_before already past, so the worker hid the message a second
-- and each return counted as a receive, towards the dead-letter queue,
-- for as long as the reaper's interval, only to hear AlreadyHandled once
-- the reaper had passed. The job ends dead whatever the message does; the
-- claim now writes that end itself, in the same statement, as reap.sql
-- writes it (attempts + 1 stopping at the largest integer, last_error,
-- finished_at, run_at, no lease), and the claimer hears the job is dead
-- (AlreadyHandled): acknowledge. A second delivery racing it waits on the
-- row lock, then re-checks the row and finds it dead too. The row lock
-- orders the claim, the reaper and the holder's heartbeat or outcome as in
-- 0260: whichever goes second re-checks the row as the first left it. The
-- body repeats 0260's but for the UPDATE making the job dead, and made_dead
-- says the call did so (the claimer counts it among dead jobs, as the
-- reaper counts the ones it makes dead). A new OUT column changes the
-- function's row type, which CREATE OR REPLACE cannot: dropped first.
DROP FUNCTION pgonce.job_claim(bigint, double precision);
CREATE FUNCTION pgonce.job_claim(
    job_id     bigint,
    lease_secs double precision,
    OUT claimed_token     uuid,
    OUT claimed_until     timestamptz,
    OUT found_status      text,
    OUT found_run_at      timestamptz,
    OUT found_lease_until timestamptz,
    OUT made_dead         boolean
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
        made_dead := false;
        RETURN NEXT;
        RETURN;
    END IF;
    UPDATE pgonce.jobs AS j
    SET attempts = least(j.attempts, 2147483646) + 1,
        status = 'dead',
        last_error = 'lease expired on the last of ' || j.max_attempts || ' attempts',
        finished_at = now(),
        run_at = now(),
        lease_token = NULL,
        lease_expires_at = NULL
    WHERE j.id = job_claim.job_id
      AND j.status = 'processing'
      AND j.lease_expires_at < now()
      AND j.attempts >= j.max_attempts - 1;
    made_dead := FOUND;
    RETURN QUERY
        SELECT NULL::uuid, NULL::timestamptz, j.status, j.run_at, j.lease_expires_at, made_dead
        FROM pgonce.jobs AS j
        WHERE j.id = job_claim.job_id;
END
$$;
