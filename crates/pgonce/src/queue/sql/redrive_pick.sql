-- Redrive, first step: up to $2 dead-lettered messages of dead-letter queue
-- $1, in their order (a FIFO group's order, then id), each with the queue
-- it goes back to and its FIFO group.
-- Read without locks: the caller takes the groups' locks first, then
-- redrive.sql locks each message and checks it again, so a redrive never
-- waits for a group's lock while it holds a message's.
-- Not one a consumer of the dead-letter queue has in flight: it would be
-- handled twice at once.
SELECT id, dead_lettered_from AS source, group_id
FROM pgonce.queue_message
WHERE queue = $1 AND dead_lettered_from IS NOT NULL AND visible_at <= now()
ORDER BY coalesce(group_position, id)
LIMIT $2
