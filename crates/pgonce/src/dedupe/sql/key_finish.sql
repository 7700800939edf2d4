-- Stores the response, fenced by the hold's token: one row when it did.
-- $4 is the response's JSON text, kept as given (a json column, migration
-- 0280): bound as jsonb it would be normalised on the way in.
-- Matching nothing, it asks pgonce.fence_lost (migration 0200) whether the
-- caller's snapshot merely predates the hold ($5, the transaction that
-- took it): then 40001, retry the transaction; otherwise no row, the hold
-- is lost. The second branch runs after the first has read the whole
-- UPDATE, and never returns a row.
WITH finished AS (
    UPDATE pgonce.idempotency_keys
    SET status = 'done',
        response = $4::json,
        hold_token = NULL,
        held_until = NULL,
        finished_at = now()
    WHERE scope = $1 AND key = $2
      AND status = 'in_progress'
      AND hold_token = $3
    RETURNING 1 AS finished
)
SELECT finished FROM finished
UNION ALL
SELECT 1 WHERE CASE WHEN EXISTS (SELECT FROM finished) THEN false
    ELSE pgonce.fence_lost($5, 'the hold on idempotency key ' || $1 || '/' || $2) END
