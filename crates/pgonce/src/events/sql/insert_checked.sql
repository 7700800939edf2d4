-- The condition check and the insert in one statement (one round trip): the
-- events are inserted only if no event after $1 matches the condition's query;
-- the first matching positions are returned either way. One statement, one
-- snapshot: under READ COMMITTED it is taken when this statement starts,
-- after begin_locked.sql granted every lock, so it sees every append those
-- locks waited for. Nothing is inserted (no position drawn) on a match.
--
-- $1: after (0 without one); $2: a JSON array of {type, tags, data,
-- metadata}, inserted in that order; $3: the NOTIFY channel or NULL (the
-- NOTIFY, carrying the last position, is delivered only on commit).
-- The filter is built from placeholders only (query.rs), from $4 on.
-- The position bound is on `e.position`, or under SERIALIZABLE `e.position + 0`, which
-- keeps the planner off the primary key: a range scan on `position > $1`
-- near the head would take an SIREAD lock on the key's right-edge page,
-- where every append inserts, and turn disjoint appends into serialization
-- failures; probing the GIN (tags) or (type, position) index instead locks
-- only the query's own keys.
WITH matching AS (
    SELECT position FROM pgonce.events e
    WHERE ({filter}) AND {position} > $1
    ORDER BY e.position
    LIMIT 16
), inserted AS (
    INSERT INTO pgonce.events (type, tags, data, metadata)
    SELECT x.ev->>'type',
           ARRAY(SELECT jsonb_array_elements_text(x.ev->'tags')),
           x.ev->'data',
           x.ev->'metadata'
    FROM jsonb_array_elements($2) WITH ORDINALITY AS x(ev, n)
    WHERE NOT EXISTS (SELECT FROM matching)
    ORDER BY x.n
    RETURNING position
)
SELECT ARRAY(SELECT position FROM matching ORDER BY position) AS matching,
       ARRAY(SELECT position FROM inserted ORDER BY position) AS positions,
       CASE WHEN $3::text IS NULL THEN ''
            ELSE (SELECT pg_notify($3, max(position)::text)::text FROM inserted
                  HAVING count(*) > 0)
       END AS notified
