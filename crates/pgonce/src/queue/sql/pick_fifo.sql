    -- FIFO queue: only the head of each group, and only when visible. A head
    -- in flight (or delayed) is not visible, and everything behind it is not
    -- a head: at most one message per group in flight, in order. Other
    -- groups' heads are independent of it.
    SELECT m.id, m.sent_at, m.receive_count, m.receive_base
    FROM pgonce.queue_message m
    WHERE m.queue = $1 AND m.visible_at <= now()
      AND NOT EXISTS (
          SELECT 1 FROM pgonce.queue_message e
          WHERE e.queue = m.queue AND e.group_id = m.group_id AND e.id < m.id)
    ORDER BY m.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
