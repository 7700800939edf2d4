-- $1 queue. Depth counts messages receivable now; in flight, received and
-- not yet visible again; delayed, never received and not yet visible.
SELECT
    count(m.id) FILTER (WHERE m.visible_at <= now()) AS depth,
    count(m.id) FILTER (WHERE m.visible_at > now() AND m.receive_count > 0) AS in_flight,
    count(m.id) FILTER (WHERE m.visible_at > now() AND m.receive_count = 0) AS delayed,
    (extract(epoch FROM now() - min(m.sent_at)) * 1000)::bigint AS oldest_ms,
    (SELECT count(*) FROM pgonce.queue_message d WHERE d.queue = q.dead_letter_queue) AS dead_letter_depth,
    q.dead_letter_queue
FROM pgonce.queue q
LEFT JOIN pgonce.queue_message m ON m.queue = q.name
WHERE q.name = $1
GROUP BY q.name, q.dead_letter_queue
