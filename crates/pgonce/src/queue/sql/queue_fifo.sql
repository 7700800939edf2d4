-- $1 name. Whether the queue is FIFO; no row when it does not exist.
SELECT fifo FROM pgonce.queue WHERE name = $1
