-- Redrive, first step: up to $2 dead-lettered messages of dead-letter queue
-- $1, in their order (a FIFO group's order, then id), each with the queue
-- it goes back to and its FIFO group. None from the queues $3, found gone
-- by an earlier batch of the redrive: their letters stay.
-- Read without locks: the caller takes the groups' locks first, then
-- redrive.sql locks each message and checks it again, so a redrive never
-- waits for a group's lock while it holds a message's.
-- Not one a consumer of the dead-letter queue has in flight: it would be
-- handled twice at once. Nor one behind an earlier dead letter of its FIFO
-- group that has to stay (in flight here): it would overtake it, running
-- in the source queue while that one is in flight here and coming before
-- it there once that one is redriven. The group's messages that are not
-- dead letters (sent here, or redriven here from this queue's own
-- dead-letter queue) never leave by a redrive, so they hold nothing back.
SELECT m.id, m.dead_lettered_from AS source, m.group_id
FROM pgonce.queue_message m
WHERE m.queue = $1 AND m.dead_lettered_from IS NOT NULL AND m.visible_at <= now()
  AND m.dead_lettered_from <> ALL ($3::text[])
  AND NOT EXISTS (
      SELECT 1 FROM pgonce.queue_message e
      WHERE e.queue = m.queue AND e.group_id = m.group_id
        AND coalesce(e.group_position, e.id) < coalesce(m.group_position, m.id)
        AND e.dead_lettered_from IS NOT NULL AND e.visible_at > now())
ORDER BY coalesce(m.group_position, m.id)
LIMIT $2
