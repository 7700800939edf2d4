-- Redrive, second step: the messages $2 (from redrive_pick.sql) that are
-- still dead-lettered in $1 from the queues $3 (the first step's, whose
-- groups' locks are held) and not in flight go back to those queues,
-- visible now, with a fresh dead-letter count (receive_base) and a new
-- generation, so no receipt from before the move acts on them.
-- `id = ANY($2)` lets the primary key find them (delete_batch.sql).
-- A FIFO message rejoins its group at the back: a position drawn from the
-- id sequence now, with its group's lock held by this transaction (taken
-- before this statement, as send.sql takes it before drawing an id), so
-- within a group positions follow commit order and the message is behind
-- everything sent before the redrive (pick_fifo.sql). Messages of one group
-- redriven together keep the order they had in the dead-letter queue:
-- positions are drawn in that order.
WITH picked AS (
    SELECT m.id, m.group_id, coalesce(m.group_position, m.id) AS position
    FROM pgonce.queue_message m
    JOIN unnest($2::bigint[], $3::text[]) AS r(id, source) ON r.id = m.id
    WHERE m.id = ANY($2) AND m.queue = $1 AND m.dead_lettered_from = r.source AND m.visible_at <= now()
    ORDER BY coalesce(m.group_position, m.id)
    FOR UPDATE OF m SKIP LOCKED
), placed AS (
    -- A FIFO message moves only with every earlier dead letter of its group
    -- in this queue (redrive_pick.sql): checked again against the messages
    -- locked above, since one may have been delivered, or locked by a
    -- receive, since the first step read it.
    SELECT p.id,
           CASE WHEN p.group_id IS NOT NULL
                THEN nextval('pgonce.queue_message_id_seq') END AS group_position
    FROM picked p
    WHERE NOT EXISTS (
        SELECT 1 FROM pgonce.queue_message e
        WHERE e.queue = $1 AND e.group_id = p.group_id
          AND coalesce(e.group_position, e.id) < p.position
          AND e.dead_lettered_from IS NOT NULL
          AND e.id NOT IN (SELECT id FROM picked))
)
UPDATE pgonce.queue_message m
SET queue = m.dead_lettered_from,
    dead_lettered_from = NULL,
    receive_base = m.receive_count,
    generation = m.generation + 1,
    visible_at = now(),
    group_position = placed.group_position,
    history = m.history || jsonb_build_array(jsonb_build_object(
        'event', 'redriven', 'from', $1, 'to', m.dead_lettered_from, 'at', now()))
FROM placed
WHERE m.id = placed.id
RETURNING m.id
