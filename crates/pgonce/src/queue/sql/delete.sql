-- Delete by receipt: $1 queue (the receipt's, which is the handle's), $2
-- id, $3 the generation the receipt was issued at. 0 rows: the receipt is
-- stale (redelivered since, moved, redriven, deleted).
DELETE FROM pgonce.queue_message WHERE queue = $1 AND id = $2 AND generation = $3
