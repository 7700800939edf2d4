, fate AS (
    SELECT picked.id,
           CASE WHEN picked.sent_at <= now() - q.retention_ms * interval '1 millisecond' THEN 'expired'
                WHEN q.max_receive_count IS NOT NULL
                     AND picked.receive_count - picked.receive_base >= q.max_receive_count THEN 'dead_lettered'
                ELSE 'delivered' END AS fate
    FROM picked, q
), expired AS (
    DELETE FROM pgonce.queue_message m USING fate
    WHERE m.id = fate.id AND fate.fate = 'expired'
    RETURNING m.id
), moved AS (
    UPDATE pgonce.queue_message m
    SET queue = q.dead_letter_queue,
        dead_lettered_from = m.queue,
        generation = m.generation + 1,
        visible_at = now(),
        history = m.history || jsonb_build_array(jsonb_build_object(
            'event', 'dead_lettered', 'from', m.queue, 'to', q.dead_letter_queue,
            'receive_count', m.receive_count, 'first_received_at', m.first_received_at,
            'at', now()))
    FROM fate, q
    WHERE m.id = fate.id AND fate.fate = 'dead_lettered'
    RETURNING m.id
), delivered AS (
    UPDATE pgonce.queue_message m
    SET receive_count = m.receive_count + 1,
        generation = m.generation + 1,
        visible_at = now() + coalesce($3, q.visibility_timeout_ms) * interval '1 millisecond',
        first_received_at = coalesce(m.first_received_at, now())
    FROM fate, q
    WHERE m.id = fate.id AND fate.fate = 'delivered'
    RETURNING m.id, m.body, m.attributes, m.group_id, m.receive_count, m.generation, m.sent_at
)
SELECT 'delivered' AS fate, id, body, attributes, group_id, receive_count, generation, sent_at FROM delivered
UNION ALL
SELECT 'dead_lettered', id, NULL, NULL, NULL, NULL, NULL, NULL FROM moved
UNION ALL
SELECT 'expired', id, NULL, NULL, NULL, NULL, NULL, NULL FROM expired
