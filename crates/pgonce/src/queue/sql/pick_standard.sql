    -- Standard queue: the earliest visible messages.
    SELECT m.id, m.group_id, m.visible_at, m.sent_at, m.receive_count, m.receive_base
    FROM pgonce.queue_message m
    -- $4: messages to pass over; a standard queue holds none back (its
    -- messages have no group), so it is always empty here.
    WHERE m.queue = $1 AND m.visible_at <= now() AND m.id <> ALL($4::bigint[])
    ORDER BY m.visible_at, m.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
