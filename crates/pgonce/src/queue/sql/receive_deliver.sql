), delivered AS (
    UPDATE pgonce.queue_message m
    -- Saturates rather than failing the whole receive at the top of the
    -- column's type (a message bouncing through a cycle of dead-letter
    -- queues is received without end); receipts fence on generation.
    SET receive_count = CASE WHEN m.receive_count < 2147483647
                             THEN m.receive_count + 1 ELSE m.receive_count END,
        -- At the top the base goes down instead, so that the dead-letter
        -- rule (receive_count - receive_base, receive_judge.sql) still
        -- counts this receive: with the count stuck, the message was
        -- delivered from its queue forever and never moved. Never below
        -- 0: the difference is then the type's top, at least any
        -- max_receive_count, and the next receive moves it.
        receive_base = CASE WHEN m.receive_count = 2147483647 AND m.receive_base > 0
                            THEN m.receive_base - 1 ELSE m.receive_base END,
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
       visibility_ms, NULL::bigint AS next_visible_ms, NULL::text AS dead_letter_queue
FROM delivered
