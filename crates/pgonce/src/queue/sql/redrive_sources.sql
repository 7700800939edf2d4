-- Redrive, before it moves anything: the queues $1 its picked dead letters
-- came from, with their kinds, each locked against deletion until the
-- redrive commits (the lock the move's foreign key check takes, taken
-- first). A queue missing here was deleted by hand since its letters came.
SELECT name, fifo
FROM pgonce.queue
WHERE name = ANY($1)
ORDER BY name
FOR KEY SHARE
