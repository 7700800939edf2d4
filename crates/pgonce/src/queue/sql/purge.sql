-- Every message of queue $1, whatever its state.
DELETE FROM pgonce.queue_message WHERE queue = $1
