-- Matching events in ($1, $2], in order. {filter} from $3 on.
SELECT position, type, tags, data, metadata FROM pgonce.events e
WHERE ({filter}) AND e.position > $1 AND e.position <= $2
ORDER BY e.position
