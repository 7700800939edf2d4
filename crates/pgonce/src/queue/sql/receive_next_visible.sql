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
-- now(), counts as the end of 9999 (as a send time does, in
-- receive_deliver.sql).
SELECT 'next_visible', 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       ceil(extract(epoch FROM least(n.visible_at,
                                     '9999-12-31 23:59:59.999999+00'::timestamptz)
                               - now()) * 1000)::bigint,
       NULL
FROM (SELECT min(m.visible_at) AS visible_at FROM pgonce.queue_message m
      WHERE m.queue = $1 AND m.visible_at > now()) n
WHERE n.visible_at IS NOT NULL AND NOT EXISTS (SELECT 1 FROM delivered)
UNION ALL
-- Nothing delivered, and no queue $1: deleted since the handle was opened.
-- The receive says so instead of returning none, as from an empty queue.
-- Looked at only when nothing was delivered (one-time filters, in order).
SELECT 'no_queue', 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE NOT EXISTS (SELECT 1 FROM delivered) AND NOT EXISTS (SELECT 1 FROM q)
