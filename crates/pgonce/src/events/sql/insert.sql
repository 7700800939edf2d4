-- Inserts the events of one append in the order given ($1: a JSON array of
-- {type, tags, data, metadata}); positions are drawn here, in that order.
-- With $2 a channel name, a NOTIFY carrying the last position is queued; it
-- is delivered when (and only if) the transaction commits.
WITH inserted AS (
    INSERT INTO pgonce.events (type, tags, data, metadata)
    SELECT x.ev->>'type',
           ARRAY(SELECT jsonb_array_elements_text(x.ev->'tags')),
           x.ev->'data',
           x.ev->'metadata'
    FROM jsonb_array_elements($1) WITH ORDINALITY AS x(ev, n)
    ORDER BY x.n
    RETURNING position
)
SELECT array_agg(position ORDER BY position) AS positions,
       CASE WHEN $2::text IS NULL THEN ''
            ELSE (SELECT pg_notify($2, max(position)::text)::text FROM inserted)
       END AS notified
FROM inserted
