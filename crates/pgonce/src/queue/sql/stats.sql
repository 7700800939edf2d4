-- $1 queue, $2 the handle's kind (fifo): a queue of the other kind created
-- under the name since is not the handle's, and gives no row. Depth counts messages receivable now; in flight, received and
-- not yet visible again; delayed, never received and not yet visible.
SELECT
    count(m.id) FILTER (WHERE m.visible_at <= now()) AS depth,
    count(m.id) FILTER (WHERE m.visible_at > now() AND m.receive_count > 0) AS in_flight,
    count(m.id) FILTER (WHERE m.visible_at > now() AND m.receive_count = 0) AS delayed,
    -- A sent_at written by hand past what pgonce reads back (infinity,
    -- -infinity), which PostgreSQL cannot subtract from now(), counts from
    -- the nearest end of that range, as a receive reads it
    -- (receive_deliver.sql): 4714-11-24 BC, the end of 9999 in UTC (an age
    -- below zero reads as zero).
    (extract(epoch FROM now() - least(greatest(min(m.sent_at),
                                               '4714-11-24 00:00:00+00 BC'::timestamptz),
                                      '9999-12-31 23:59:59.999999+00'::timestamptz))
     * 1000)::bigint AS oldest_ms,
    (SELECT count(*) FROM pgonce.queue_message d WHERE d.queue = q.dead_letter_queue) AS dead_letter_depth,
    q.dead_letter_queue
FROM pgonce.queue q
LEFT JOIN pgonce.queue_message m ON m.queue = q.name
WHERE q.name = $1 AND q.fifo = $2
GROUP BY q.name, q.dead_letter_queue
