    -- Standard queue: the earliest visible messages.
    SELECT m.id, m.group_id, m.sent_at, m.receive_count, m.receive_base
    FROM pgonce.queue_message m
    WHERE m.queue = $1 AND m.visible_at <= now()
    ORDER BY m.visible_at, m.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
