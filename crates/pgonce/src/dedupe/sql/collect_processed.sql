WITH old AS (
    SELECT consumer, message_id
    FROM pgonce.processed_messages
    WHERE processed_at < now() - make_interval(secs => $1)
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM pgonce.processed_messages AS p
USING old
WHERE p.consumer = old.consumer AND p.message_id = old.message_id
