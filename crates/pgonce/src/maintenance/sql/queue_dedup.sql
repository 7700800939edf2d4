-- Up to $2 deduplication claims whose window ended more than $1 seconds
-- ago. A send that renews an expired claim locks it (ON CONFLICT DO UPDATE):
-- skipped here, and its new expires_at no longer matches.
WITH old AS (
    SELECT queue, dedup_id FROM pgonce.queue_dedup
    WHERE expires_at < now() - make_interval(secs => $1)
    ORDER BY expires_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM pgonce.queue_dedup AS d
USING old
WHERE d.queue = old.queue AND d.dedup_id = old.dedup_id
  AND d.expires_at < now() - make_interval(secs => $1)
