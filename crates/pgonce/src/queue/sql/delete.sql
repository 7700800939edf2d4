-- Delete by receipt: $1 queue, $2 id, $3 the receive count the receipt was
-- issued at. 0 rows: the receipt is stale (redelivered since, moved,
-- deleted).
DELETE FROM pgonce.queue_message WHERE queue = $1 AND id = $2 AND receive_count = $3
