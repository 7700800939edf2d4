-- A failed attempt, fenced by the lease: attempts is incremented here, in
-- SQL; past max_attempts the job is dead, otherwise it waits in `failed`
-- until run_at = now + min(max, base * 2^(attempts-1)) * (1 + jitter * random()),
-- now being this statement's start, not its transaction's: a failure
-- recorded late in a caller's long transaction waits its whole backoff
-- (from the transaction's start it could be due already).
-- $3 error, $4 base seconds, $5 max seconds, $6 jitter fraction, $7 the
-- transaction that took the lease: matching nothing, the statement asks
-- pgonce.fence_lost whether the caller's snapshot merely predates the
-- claim (40001) or the lease is lost (no row; see complete.sql).
-- The count stops at the largest integer, tested as attempts >=
-- max_attempts - 1, as in reap.sql. The exponent stops at 60: float8
-- overflows near 2^1024 (after ~1,000 attempts, which max_attempts
-- allows), and 2^60 x any base is past any max.
WITH failed AS (
    UPDATE pgonce.jobs
    SET attempts = least(attempts, 2147483646) + 1,
        status = CASE WHEN attempts >= max_attempts - 1 THEN 'dead' ELSE 'failed' END,
        last_error = $3,
        run_at = CASE WHEN attempts >= max_attempts - 1 THEN run_at
                 ELSE statement_timestamp() + make_interval(secs =>
                     least($5, $4 * power(2, least(attempts, 60))) * (1 + $6 * random()))
                 END,
        finished_at = CASE WHEN attempts >= max_attempts - 1 THEN now() END,
        lease_token = NULL,
        lease_expires_at = NULL
    WHERE id = $1
      AND status = 'processing'
      AND lease_token = $2
    RETURNING status, attempts, run_at
)
-- A dead job keeps its run_at, which may have been written by hand past
-- what pgonce reads back: it reads as the nearest end of that range.
SELECT status, attempts,
       least(greatest(run_at, '4714-11-24 00:00:00+00 BC'::timestamptz),
             '9999-12-31 23:59:59.999999+00'::timestamptz) AS run_at
FROM failed
UNION ALL
SELECT NULL, NULL, NULL WHERE CASE WHEN EXISTS (SELECT FROM failed) THEN false
    ELSE pgonce.fence_lost($7, 'the lease on job ' || $1) END
