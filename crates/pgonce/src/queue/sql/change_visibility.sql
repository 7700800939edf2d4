-- Change visibility by receipt: $1 queue, $2 id, $3 generation of the
-- receipt, $4 new timeout from now, ms. 0 rows: the receipt is stale.
UPDATE pgonce.queue_message
SET visible_at = now() + $4 * interval '1 millisecond'
WHERE queue = $1 AND id = $2 AND generation = $3
