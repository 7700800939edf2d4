-- delete_batch.sql for a FIFO queue (a single delete is a batch of one),
-- and for each message deleted whether its group has another message in
-- the queue: deleting a head in flight makes the group's next message
-- receivable at once, and the caller wakes parked receivers for it, as a
-- send does. Not counted as the group's: the messages this statement
-- deletes, which its snapshot still shows. A message of the group
-- committed after that snapshot is not seen either; its sender notified,
-- and if the notification came while the head was still in flight, the
-- message waits for a receiver's poll (a window the length of this
-- statement). The probe is an index lookup (queue_message_group).
WITH gone AS (
    DELETE FROM pgonce.queue_message m
    USING unnest($2::bigint[], $3::bigint[]) AS r(id, generation)
    WHERE m.id = ANY($2::bigint[])
      AND m.id = r.id AND m.generation = r.generation
      AND m.queue IS NOT DISTINCT FROM $1
      -- A FIFO handle's statement: only while $1 is a FIFO queue (see
      -- delete.sql).
      AND EXISTS (SELECT FROM pgonce.queue q WHERE q.name = $1 AND q.fifo)
    RETURNING m.id, m.generation, m.queue, m.group_id
)
SELECT gone.id, gone.generation,
       EXISTS (SELECT 1 FROM pgonce.queue_message n
               WHERE n.queue = gone.queue AND n.group_id = gone.group_id
                 AND n.id <> ALL ($2::bigint[])) AS group_goes_on
FROM gone
