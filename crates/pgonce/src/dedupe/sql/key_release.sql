-- Gives the key up, fenced by the hold's token: one row when it did.
-- Matching nothing, it asks pgonce.fence_lost (migration 0200) whether the
-- caller's snapshot merely predates the hold ($4, the transaction that
-- took it): then 40001, retry the transaction; otherwise no row, the hold
-- is lost (see key_finish.sql).
WITH released AS (
    DELETE FROM pgonce.idempotency_keys
    WHERE scope = $1 AND key = $2
      AND status = 'in_progress'
      AND hold_token = $3
    RETURNING 1 AS released
)
SELECT released FROM released
UNION ALL
SELECT 1 WHERE CASE WHEN EXISTS (SELECT FROM released) THEN false
    ELSE pgonce.fence_lost($4, 'the hold on idempotency key ' || $1 || '/' || $2) END
