-- Delete several deliveries by receipt: $1 queue, $2 ids, $3 the
-- generations of the receipts. Returns (id, generation) of each delivery
-- deleted: a receipt whose pair is missing was stale, even when another
-- receipt in the batch deleted its message. (And, as delete_fifo.sql
-- does, whether the message's group goes on: never, in a standard queue.)
-- The messages are read by primary key (`id = ANY`), the only condition on
-- them an index can drive: the queue check cannot, for the reason
-- delete.sql gives. Without `id = ANY`, the planner hash-joined the
-- receipts against every message of the queue, read through
-- queue_message_visible. The join with the receipts stays a join (linear
-- in the batch; a sub-select per message would scan the batch once per
-- message), and its re-check after a concurrent update pairs the new row
-- version with the receipt it matched.
DELETE FROM pgonce.queue_message m
USING unnest($2::bigint[], $3::bigint[]) AS r(id, generation)
WHERE m.id = ANY($2::bigint[])
  AND m.id = r.id AND m.generation = r.generation
  AND m.queue IS NOT DISTINCT FROM $1
  -- A standard queue's statement (delete_fifo.sql is the FIFO one): the
  -- handle's kind, as delete.sql says why.
  AND EXISTS (SELECT FROM pgonce.queue q WHERE q.name = $1 AND NOT q.fifo)
RETURNING m.id, m.generation, false AS group_goes_on
