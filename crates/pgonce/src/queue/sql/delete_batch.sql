-- Delete several deliveries by receipt: $1 queue, $2 ids, $3 the receive
-- counts of the receipts. Returns the ids deleted; a receipt whose id is
-- missing was stale.
DELETE FROM pgonce.queue_message m
USING unnest($2::bigint[], $3::integer[]) AS r(id, receive_count)
WHERE m.queue = $1 AND m.id = r.id AND m.receive_count = r.receive_count
RETURNING m.id
