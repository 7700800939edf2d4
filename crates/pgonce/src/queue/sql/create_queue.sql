-- $1 name, $2 fifo, $3 visibility ms, $4 retention ms, $5 delay ms,
-- $6 max receive count, $7 dead-letter queue, $8 dedup window ms,
-- $9 content-based dedup. Creates the queue or updates its attributes. The
-- kind (fifo) never changes: a queue of the other kind is left as it is and
-- no row is returned.
INSERT INTO pgonce.queue (name, fifo, visibility_timeout_ms, retention_ms, delay_ms,
                          max_receive_count, dead_letter_queue, dedup_window_ms,
                          content_based_dedup)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (name) DO UPDATE
SET visibility_timeout_ms = EXCLUDED.visibility_timeout_ms,
    retention_ms          = EXCLUDED.retention_ms,
    delay_ms              = EXCLUDED.delay_ms,
    max_receive_count     = EXCLUDED.max_receive_count,
    dead_letter_queue     = EXCLUDED.dead_letter_queue,
    dedup_window_ms       = EXCLUDED.dedup_window_ms,
    content_based_dedup   = EXCLUDED.content_based_dedup
WHERE pgonce.queue.fifo = EXCLUDED.fifo
RETURNING fifo
