-- FIFO receives walk their own queue's messages in id order.
--
-- A FIFO receive looks for group heads in id order and stops at its batch
-- size (pick_fifo.sql). With only the primary key giving id order, the
-- planner walked the primary key through every queue's messages and
-- filtered on the queue: with a busy standard queue's 3,000 messages below
-- a FIFO queue's 40, a receive read 3,020 rows to find 10 heads.
-- This index gives one queue's FIFO messages in id order. It holds FIFO
-- messages only (every one has a group; a standard queue's have none), so
-- standard sends do not maintain it. It does not index the group, so the
-- head probe, which needs the group, keeps queue_message_group.
--
-- A FIFO queue's receive now sees grouped messages only. The one way a
-- message without a group reached a FIFO queue was a standard queue
-- dead-lettering into it, which `PgQueue::create` refuses from this
-- version on, as SQS does. A database configured that way before would
-- strand those dead letters, so the migration stops and names the queues
-- to change first (their `dead_letter_queue`, to a standard queue), and
-- the FIFO queues already holding such messages (redrive them to their
-- standard source, or purge them).
DO $$
DECLARE
    mixed text;
    groupless text;
BEGIN
    SELECT string_agg(DISTINCT q.name, ', ') INTO groupless
    FROM pgonce.queue_message m JOIN pgonce.queue q ON q.name = m.queue
    WHERE q.fifo AND m.group_id IS NULL;
    IF groupless IS NOT NULL THEN
        RAISE EXCEPTION 'FIFO queues holding messages without a group: %', groupless
            USING HINT = 'These came from a standard queue dead-lettering into a FIFO queue: move them back with PgQueue::redrive on each of these queues, or purge them, then migrate again.';
    END IF;
    SELECT string_agg(format('%s (%s) -> %s (%s)', s.name,
                             CASE WHEN s.fifo THEN 'FIFO' ELSE 'standard' END, d.name,
                             CASE WHEN d.fifo THEN 'FIFO' ELSE 'standard' END), ', ')
    INTO mixed
    FROM pgonce.queue s JOIN pgonce.queue d ON d.name = s.dead_letter_queue
    WHERE s.fifo <> d.fifo;
    IF mixed IS NOT NULL THEN
        RAISE EXCEPTION 'queues whose dead-letter queue is of the other kind: %', mixed
            USING HINT = 'Give each a dead-letter queue of its own kind (pgonce.queue.dead_letter_queue), then migrate again.';
    END IF;
END
$$;

CREATE INDEX queue_message_fifo_walk ON pgonce.queue_message (queue, id)
    WHERE group_id IS NOT NULL;
