-- Move up to $2 dead-lettered messages of dead-letter queue $1 back to the
-- queues they came from, visible now, with a fresh dead-letter count
-- (receive_base) and a new generation, so no receipt from before the move
-- acts on it.
WITH picked AS (
    SELECT id FROM pgonce.queue_message
    -- Not one a consumer of the dead-letter queue has in flight: it would
    -- be handled twice at once.
    WHERE queue = $1 AND dead_lettered_from IS NOT NULL AND visible_at <= now()
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE pgonce.queue_message m
SET queue = m.dead_lettered_from,
    dead_lettered_from = NULL,
    receive_base = m.receive_count,
    generation = m.generation + 1,
    visible_at = now(),
    history = m.history || jsonb_build_array(jsonb_build_object(
        'event', 'redriven', 'from', $1, 'to', m.dead_lettered_from, 'at', now()))
FROM picked
WHERE m.id = picked.id
RETURNING m.id, m.queue
