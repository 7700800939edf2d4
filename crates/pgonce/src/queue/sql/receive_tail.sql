, judged AS (
    -- What each picked message's fate would be.
    -- A FIFO message moved to the dead-letter queue goes to the back of its
    -- group there, as a send to that queue would: under the group's lock in
    -- the dead-letter queue (send.sql's key), held until the receive
    -- commits, with a position drawn after it was granted (moved). So
    -- positions in the dead-letter queue's group follow commit order, and
    -- a moved message never lands ahead of one in flight there (migration
    -- 0132). The lock is only tried: when a sender holds it, the message
    -- is held back (neither moved nor delivered, left as it was for a
    -- later receive), so a receive never waits for another transaction,
    -- which would let the leases it hands out run while it waits and could
    -- deadlock with a sender that locks several groups in its own order.
    -- Only picked rows get here (after the pick's LIMIT), so the receive
    -- tries at most one lock per message it picked.
    SELECT picked.id,
           CASE WHEN picked.sent_at <= now() - q.retention_ms * interval '1 millisecond' THEN 'expired'
                WHEN q.max_receive_count IS NOT NULL
                     AND picked.receive_count - picked.receive_base >= q.max_receive_count
                THEN CASE WHEN picked.group_id IS NULL
                            OR pg_try_advisory_xact_lock(pgonce.lock_key(
                                   'pgonce.queue/' || q.dead_letter_queue, picked.group_id))
                          THEN 'dead_lettered' ELSE 'held' END
                ELSE 'delivered' END AS fate
    FROM picked, q
), fate AS (
    -- At most $5 deliveries: the pick looks at up to $2 messages, so that
    -- heads held back, moved or expired do not take the batch's places;
    -- deliveries past $5 are left untouched ('skipped'), in id order.
    SELECT id,
           CASE WHEN fate = 'delivered'
                     AND count(*) FILTER (WHERE fate = 'delivered')
                         OVER (ORDER BY id ROWS UNBOUNDED PRECEDING) > $5
                THEN 'skipped' ELSE fate END AS fate
    FROM judged
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
    RETURNING m.id
), delivered AS (
    UPDATE pgonce.queue_message m
    -- Saturates rather than failing the whole receive at the top of the
    -- column's type (a message bouncing through a cycle of dead-letter
    -- queues is received without end); receipts fence on generation.
    SET receive_count = CASE WHEN m.receive_count < 2147483647
                             THEN m.receive_count + 1 ELSE m.receive_count END,
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
UNION ALL
SELECT 'held', id, NULL, NULL, NULL, NULL, NULL, NULL FROM fate WHERE fate = 'held'
UNION ALL
SELECT 'skipped', id, NULL, NULL, NULL, NULL, NULL, NULL FROM fate WHERE fate = 'skipped'
