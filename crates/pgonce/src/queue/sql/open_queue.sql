-- $1 name.
SELECT fifo, content_based_dedup, dead_letter_queue FROM pgonce.queue WHERE name = $1
