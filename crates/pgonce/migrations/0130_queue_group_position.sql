-- A FIFO message's place in its group, apart from its id.
--
-- A FIFO receive takes a message only when no message of its group comes
-- before it in the queue (pick_fifo.sql). Until this migration "before"
-- meant a smaller id. A redrive moves a dead-lettered message back with its
-- id (receipts, history and a sender's reference name it), so it came back
-- ahead of the group's later messages: if one of them was in flight at the
-- time, the redriven message was its group's head and was delivered beside
-- it, two messages of one group in flight at once.
--
-- Now a redrive gives a FIFO message a position drawn from the id sequence
-- under its group's lock, as a send draws an id (send.sql): it rejoins its
-- group behind every message sent before the redrive, as SQS re-sends a
-- redriven message at the back of its group. NULL, as for every sent
-- message, means the id. The column is nullable so that adding it rewrites
-- nothing.
ALTER TABLE pgonce.queue_message ADD COLUMN group_position bigint;

COMMENT ON COLUMN pgonce.queue_message.group_position IS
    'Order within its FIFO group when not its id: set by a redrive, which puts the message behind every message of its group sent before it. NULL: the id.';

-- The head probe ("is there an earlier message in this group?") compares
-- positions now.
DROP INDEX pgonce.queue_message_group;
CREATE INDEX queue_message_group
    ON pgonce.queue_message (queue, group_id, (coalesce(group_position, id)))
    WHERE group_id IS NOT NULL;
