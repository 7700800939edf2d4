-- Delete several deliveries by receipt: $1 queue, $2 ids, $3 the
-- generations of the receipts. Returns (id, generation) of each delivery
-- deleted: a receipt whose pair is missing was stale, even when another
-- receipt in the batch deleted its message.
DELETE FROM pgonce.queue_message m
USING unnest($2::bigint[], $3::bigint[]) AS r(id, generation)
WHERE m.queue = $1 AND m.id = r.id AND m.generation = r.generation
RETURNING m.id, m.generation
