-- I6: messages of the round's queue still stored after the drain.
SELECT count(*) FROM pgonce.queue_message WHERE queue = $1
