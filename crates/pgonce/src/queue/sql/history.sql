-- $1 message id: the queue it is in now and its move history.
SELECT queue, history FROM pgonce.queue_message WHERE id = $1
