-- read(query, from, limit, forwards). {filter} from $4 on.
SELECT position, type, tags, data, metadata FROM pgonce.events e
WHERE ({filter}) AND e.position >= $1
ORDER BY e.position
LIMIT $2
