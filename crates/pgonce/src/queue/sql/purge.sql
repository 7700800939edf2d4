-- Every message of queue $1, whatever its state, while $1 is a queue of
-- the handle's kind ($2, fifo): a queue deleted by hand since the handle
-- was opened, or created again as the other kind, is not its queue, and
-- its purge deletes nothing there. `found` says whether it was.
WITH q AS (
    SELECT name FROM pgonce.queue WHERE name = $1 AND fifo = $2
), purged AS (
    DELETE FROM pgonce.queue_message m USING q WHERE m.queue = q.name
    RETURNING m.id
)
SELECT EXISTS (SELECT FROM q) AS found, (SELECT count(*) FROM purged) AS purged
