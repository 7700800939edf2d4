-- Delete by receipt: $1 queue (the receipt's, which is the handle's), $2
-- id, $3 the generation the receipt was issued at. 0 rows: the receipt is
-- stale (redelivered since, moved, redriven, deleted).
-- The row is found by its primary key alone: `queue IS NOT DISTINCT FROM`
-- (the same as `=` on this NOT NULL column) cannot drive an index, so the
-- planner never reads the message through queue_message_visible, whose
-- only usable column here is `queue`: on statistics taken while the queue
-- was small, it chose that index and read every message of the queue to
-- find one (tests/queue.rs,
-- `a_receipt_finds_its_message_by_primary_key_on_stale_statistics`).
-- Only while $1 is a standard queue, the handle's kind (postgres.rs calls
-- this statement for standard handles only): a queue of the other kind created under
-- the name since the handle was opened is not its queue, and no receipt
-- acts on it through that handle.
DELETE FROM pgonce.queue_message
WHERE id = $2 AND generation = $3 AND queue IS NOT DISTINCT FROM $1
  AND EXISTS (SELECT FROM pgonce.queue q WHERE q.name = $1 AND NOT q.fifo)
