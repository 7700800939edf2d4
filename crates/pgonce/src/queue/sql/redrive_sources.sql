-- Redrive, before it moves anything: the queues $1 its picked dead letters
-- came from, and the dead-letter queue itself, with their kinds, each
-- locked against deletion until the redrive commits (the lock the move's
-- foreign key check takes, taken first). A source missing here was
-- deleted by hand since its letters came; the dead-letter queue of the
-- other kind than the handle's, deleted by hand and created again. Run
-- again when one is missing (postgres.rs, redrive_batch): a replacement
-- the first run waited for is seen by the second's snapshot.
SELECT name, fifo
FROM pgonce.queue
WHERE name = ANY($1)
ORDER BY name
FOR KEY SHARE
