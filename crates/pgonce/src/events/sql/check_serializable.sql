-- The condition check under SERIALIZABLE: as check.sql, but `position + 0`
-- keeps the planner off the primary key. A range scan on `position > $1`
-- near the head would take an SIREAD lock on the key's right-edge page,
-- where every append inserts, and turn disjoint appends into serialization
-- failures; probing the GIN (tags) or (type, position) index instead locks
-- only the query's own keys. {filter} from $2 on.
SELECT position FROM pgonce.events e
WHERE ({filter}) AND e.position + 0 > $1
ORDER BY e.position
LIMIT 16
