-- Change visibility by receipt: $1 queue, $2 id, $3 generation of the
-- receipt, $4 new timeout from now, ms. 0 rows: the receipt is stale.
-- By primary key alone, as delete.sql says why.
UPDATE pgonce.queue_message
SET visible_at = now() + $4 * interval '1 millisecond'
WHERE id = $2 AND generation = $3 AND queue IS NOT DISTINCT FROM $1
