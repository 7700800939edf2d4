-- $1 name.
SELECT fifo, content_based_dedup FROM pgonce.queue WHERE name = $1
