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
CREATE INDEX queue_message_fifo_walk ON pgonce.queue_message (queue, id)
    WHERE group_id IS NOT NULL;
