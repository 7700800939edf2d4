-- The decision read: the head and the matching events, from one snapshot
-- (one statement). Runs after the query's keys were locked, so no matching
-- append is in flight. {filter} from $1 on.
SELECT h.head, e.position, e.type, e.tags, e.data, e.metadata
FROM (SELECT max(position) AS head FROM pgonce.events) AS h
LEFT JOIN LATERAL (
    SELECT position, type, tags, data, metadata FROM pgonce.events e
    WHERE ({filter})
) AS e ON true
ORDER BY e.position
