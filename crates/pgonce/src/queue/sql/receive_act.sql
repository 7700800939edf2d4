), expired AS (
    DELETE FROM pgonce.queue_message m USING fate
    WHERE m.id = fate.id AND fate.fate = 'expired'
    RETURNING m.id
), moved AS (
    UPDATE pgonce.queue_message m
    SET queue = q.dead_letter_queue,
        dead_lettered_from = m.queue,
        -- A fresh budget in the dead-letter queue, if it has a dead-letter
        -- queue of its own: received there max_receive_count times first.
        receive_base = m.receive_count,
        generation = m.generation + 1,
        visible_at = now(),
        group_position = CASE WHEN m.group_id IS NOT NULL
                              THEN nextval('pgonce.queue_message_id_seq') END,
        history = m.history || jsonb_build_array(jsonb_build_object(
            'event', 'dead_lettered', 'from', m.queue, 'to', q.dead_letter_queue,
            'receive_count', m.receive_count, 'first_received_at', m.first_received_at,
            'at', now()))
    FROM fate, q
    WHERE m.id = fate.id AND fate.fate = 'dead_lettered'
    -- The queue it moved to, as this statement read the queue's row: the
    -- receive wakes that queue's receivers after its commit, whatever the
    -- row says by then (postgres.rs, wake_dead_letter_queues).
    RETURNING m.id, m.queue AS dead_letter_queue
