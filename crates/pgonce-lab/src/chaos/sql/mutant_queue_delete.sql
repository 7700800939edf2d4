-- Mutant: a delete by message id that ignores the receipt's generation, so
-- an earlier delivery's receipt deletes a redelivered message.
DELETE FROM pgonce.queue_message WHERE queue = $1 AND id = $2
