-- Take and remove the oldest row nobody else is taking: one statement.
DELETE FROM bench_queue_raw
WHERE id = (SELECT id FROM bench_queue_raw ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING body
