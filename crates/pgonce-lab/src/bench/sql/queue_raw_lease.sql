-- Lease the oldest visible row nobody else is taking for the visibility
-- timeout: one statement, committed before the consumer works on it.
UPDATE bench_queue_raw_lease SET visible_at = now() + interval '30 seconds'
WHERE id = (SELECT id FROM bench_queue_raw_lease
            WHERE visible_at <= now()
            ORDER BY visible_at, id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, body
