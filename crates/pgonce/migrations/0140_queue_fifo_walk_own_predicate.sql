-- The FIFO walk's index, on a predicate the head probe cannot prove.
--
-- queue_message_fifo_walk (migration 0131) was partial on
-- `group_id IS NOT NULL`. The head probe in pick_fifo.sql compares
-- `e.group_id = m.group_id`, and an equality implies its column is not
-- null, so the planner could use the walk's index for the probe too. It
-- did whenever it expected the queue to be small, as for a queue its
-- statistics have never seen (a FIFO queue created after the last
-- ANALYZE): each probe then read every message of the queue instead of
-- the group's few, and a FIFO receive of 10 among 2,000 messages read
-- 20,000 rows. Under load the receives took 25-100 ms instead of under
-- one, and the queue's throughput fell tenfold.
--
-- `group_id >= ''` holds for exactly the same rows (every message with a
-- group: no text sorts below the empty one), but the planner proves an
-- inequality only from a comparison with a constant, which the probe does
-- not have. So only the walk, which says it in these words, can use this
-- index, and the probe keeps queue_message_group. (A predicate on an
-- expression, such as `octet_length(group_id) >= 0`, excludes the probe
-- too, but the planner then estimates the index at a third of the table,
-- and a generic plan walked queue_message_group and sorted instead.)
--
-- The new index is built first, under another name, and the old one
-- dropped after: the build takes a lock that lets reads through (writes
-- to the messages wait for it, as for migration 0131's build), and the
-- drop's exclusive lock, which stops reads too, is taken only at the end,
-- for the moment the transaction takes to commit. Dropped first, the
-- exclusive lock would be held through the whole build.
CREATE INDEX queue_message_fifo_walk_0140 ON pgonce.queue_message (queue, id)
    WHERE group_id >= '';
DROP INDEX pgonce.queue_message_fifo_walk;
ALTER INDEX pgonce.queue_message_fifo_walk_0140 RENAME TO queue_message_fifo_walk;
