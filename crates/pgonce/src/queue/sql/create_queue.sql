-- $1 name, $2 fifo, $3 visibility ms, $4 retention ms, $5 delay ms,
-- $6 max receive count, $7 dead-letter queue, $8 dedup window ms,
-- $9 content-based dedup. Creates the queue or updates its attributes. The
-- kind (fifo) never changes: a queue of the other kind is left as it is and
-- no row is returned.
-- The dead-letter queue must exist and be of the queue's kind (as in SQS:
-- a FIFO queue's dead letters keep their groups, a standard queue's have
-- none, which a FIFO queue cannot order). It is checked in this statement,
-- under a lock: FOR KEY SHARE waits for a concurrent delete of it, skips
-- it once deleted (a queue recreated under its name after this statement's
-- snapshot is not seen), and keeps it from being deleted until this
-- transaction ends. No row either when that check fails; a check in a
-- statement of its own let a dead-letter queue deleted and recreated as
-- the other kind in between through.
WITH dead_letter AS (
    SELECT fifo FROM pgonce.queue WHERE name = $7 FOR KEY SHARE
)
INSERT INTO pgonce.queue (name, fifo, visibility_timeout_ms, retention_ms, delay_ms,
                          max_receive_count, dead_letter_queue, dedup_window_ms,
                          content_based_dedup)
SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9
WHERE $7::text IS NULL OR (SELECT fifo FROM dead_letter) IS NOT DISTINCT FROM $2
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
