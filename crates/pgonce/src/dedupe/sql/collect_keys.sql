-- Finished keys past their retention, and abandoned holds past it too.
WITH old AS (
    SELECT scope, key
    FROM pgonce.idempotency_keys
    WHERE created_at < now() - make_interval(secs => $1)
      AND (status = 'done' OR held_until < now())
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM pgonce.idempotency_keys AS k
USING old
WHERE k.scope = old.scope AND k.key = old.key
