-- The condition check: the first positions after $1 matching the query.
-- {filter} is built from placeholders only (query.rs), from $2 on.
SELECT position FROM pgonce.events e
WHERE ({filter}) AND e.position > $1
ORDER BY e.position
LIMIT 16
