-- Deliveries a receive made for a caller that stopped waiting for them
-- (its call dropped once a receive statement was sent, which the server
-- runs regardless): nobody has their receipts, so nobody handles the
-- messages. $1 queue, $2 ids, $3 the generations the receive gave them.
-- Each goes back as a hand-back to zero would leave it: receivable at
-- once (a FIFO head again, its group going on), and it ends the delivery
-- (generation + 1), so the receipt nobody saw deletes and hides nothing.
-- Its receive is not counted, since nobody received it: receive_count
-- goes back down, and with it the dead-letter rule's count
-- (receive_count - receive_base, receive_judge.sql), and a first receive
-- given back leaves no first_received_at. At the top of the count, where
-- receive_deliver.sql saturates, the receive stays counted.
-- Fenced by the generation: a message the receive no longer holds
-- (redelivered once a short visibility ran out, moved, purged) is left
-- as it is, and no row says so.
UPDATE pgonce.queue_message m
SET visible_at = now(),
    receive_count = CASE WHEN m.receive_count < 2147483647
                         THEN m.receive_count - 1 ELSE m.receive_count END,
    first_received_at = CASE WHEN m.receive_count = 1 THEN NULL ELSE m.first_received_at END,
    generation = m.generation + 1
FROM unnest($2::bigint[], $3::bigint[]) AS d(id, generation)
WHERE m.id = d.id AND m.generation = d.generation AND m.queue = $1
RETURNING m.id
