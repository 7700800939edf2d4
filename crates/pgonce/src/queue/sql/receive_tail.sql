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
    -- The visibility this delivery got, in ms, as visible_at was set
    -- from it: the worker's clock for when the delivery runs out.
    RETURNING m.id, m.body, m.attributes, m.group_id, m.receive_count, m.generation, m.sent_at,
              coalesce($3, q.visibility_timeout_ms) AS visibility_ms
)
-- A sent_at past what pgonce reads back (infinity, -infinity, written by
-- hand; sqlx's decoding panics on it) reads as the nearest end of that
-- range: 4714-11-24 BC, the end of 9999 in UTC (see job/sql/claim.sql).
SELECT 'delivered' AS fate, id, body, attributes, group_id, receive_count, generation,
       least(greatest(sent_at, '4714-11-24 00:00:00+00 BC'::timestamptz),
             '9999-12-31 23:59:59.999999+00'::timestamptz) AS sent_at,
       visibility_ms, NULL::bigint AS next_visible_ms
FROM delivered
UNION ALL
SELECT 'dead_lettered', id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM moved
UNION ALL
SELECT 'expired', id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM expired
UNION ALL
SELECT fate, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM fate
WHERE fate IN ('held', 'skipped')
UNION ALL
-- Picked and locked, but not acted on: a message the standard pick's
-- snapshot saw and this statement's did not (committed in between by a
-- transaction that began before this one; migration 0160). It took a
-- place of the batch and its lock turned other receivers away; the
-- receive looks again, and wakes them.
SELECT 'unseen', fate.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM fate
WHERE fate.fate IN ('delivered', 'dead_lettered', 'expired')
  AND fate.id NOT IN (SELECT id FROM delivered UNION ALL SELECT id FROM moved
                      UNION ALL SELECT id FROM expired)
UNION ALL
-- Nothing delivered: in how many ms (rounded up) the queue's next message
-- becomes visible, sent with a delay, handed back with one, or its lease
-- running out, so that a long poll wakes then instead of at its poll
-- interval. One descent of queue_message_visible, made only when nothing
-- was delivered: a statement that delivers never reads it (the NOT EXISTS
-- is a one-time filter). In a FIFO queue the message may be a head's
-- follower, which is visible and still not receivable: the long poll then
-- wakes early, looks, and sleeps to the next such time. A visible_at
-- written by hand as infinity, which PostgreSQL cannot subtract from
-- now(), counts as the end of 9999 (as a send time does, above).
SELECT 'next_visible', 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       ceil(extract(epoch FROM least(n.visible_at,
                                     '9999-12-31 23:59:59.999999+00'::timestamptz)
                               - now()) * 1000)::bigint
FROM (SELECT min(m.visible_at) AS visible_at FROM pgonce.queue_message m
      WHERE m.queue = $1 AND m.visible_at > now()) n
WHERE n.visible_at IS NOT NULL AND NOT EXISTS (SELECT 1 FROM delivered)
UNION ALL
-- Nothing delivered, and no queue $1: deleted since the handle was opened.
-- The receive says so instead of returning none, as from an empty queue.
-- Looked at only when nothing was delivered (one-time filters, in order).
SELECT 'no_queue', 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE NOT EXISTS (SELECT 1 FROM delivered) AND NOT EXISTS (SELECT 1 FROM q)
