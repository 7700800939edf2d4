-- Delete several deliveries by receipt: $1 queue, $2 ids, $3 the
-- generations of the receipts. Returns (id, generation) of each delivery
-- deleted: a receipt whose pair is missing was stale, even when another
-- receipt in the batch deleted its message.
-- One primary-key probe per id (`id = ANY`), each row then matched against
-- the batch's generations for its id (a correlated sub-select, which the
-- planner keeps per row instead of joining): a join with the unnested
-- receipts let the planner hash-join against every message of the queue,
-- read through queue_message_visible, and the queue check is not an
-- index condition for the reason delete.sql gives.
DELETE FROM pgonce.queue_message m
WHERE m.id = ANY($2::bigint[])
  AND m.generation = ANY (
      SELECT r.generation FROM unnest($2::bigint[], $3::bigint[]) AS r(id, generation)
      WHERE r.id = m.id)
  AND m.queue IS NOT DISTINCT FROM $1
RETURNING m.id, m.generation
