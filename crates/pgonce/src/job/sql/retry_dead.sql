-- Dead jobs back to pending, each with an audit row, in one statement.
-- $1 job id, $2 kind, $3 dead since, $4 dead before (each NULL: any),
-- $5 limit, $6 who, $7 why.
-- FOR UPDATE: a concurrent retrier of the same job waits, then re-checks
-- status = 'dead' against the committed row and skips it, so a job is
-- retried, and audited, once.
WITH target AS (
    SELECT id, attempts, last_error, finished_at
    FROM pgonce.jobs
    WHERE status = 'dead'
      AND ($1::bigint IS NULL OR id = $1)
      AND ($2::text IS NULL OR kind = $2)
      AND ($3::timestamptz IS NULL OR finished_at >= $3)
      AND ($4::timestamptz IS NULL OR finished_at < $4)
    ORDER BY finished_at, id
    LIMIT $5
    FOR UPDATE
), retried AS (
    UPDATE pgonce.jobs AS j
    SET status = 'pending',
        attempts = 0,
        run_at = now(),
        finished_at = NULL
    FROM target
    WHERE j.id = target.id
      AND j.status = 'dead'
    RETURNING j.id
), audit AS (
    INSERT INTO pgonce.job_retries (job_id, retried_by, reason, previous_attempts, previous_error, dead_since)
    SELECT t.id, $6, $7, t.attempts, t.last_error, t.finished_at
    FROM target AS t
    JOIN retried AS r ON r.id = t.id
)
SELECT id FROM retried ORDER BY id
