-- Where the queue messages $1 (ids as text) are now: in a queue (with
-- their receive count, and whether a receiver holds them), or nowhere
-- (deleted). Read-only.
SELECT ids.id AS message_id,
       m.queue,
       m.receive_count,
       (m.visible_at > now()) AS in_flight
  FROM unnest($1::text[]) AS ids(id)
  LEFT JOIN pgonce.queue_message m ON m.id::text = ids.id
 ORDER BY ids.id
