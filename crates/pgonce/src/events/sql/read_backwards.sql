-- read(query, from, limit, backwards). {filter} from $3 on.
SELECT position, type, tags, data, metadata FROM pgonce.events e
WHERE ({filter}) AND e.position <= $1
ORDER BY e.position DESC
LIMIT $2
