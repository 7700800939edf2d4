-- decide_one_statement.sql for a query of one item naming tags and no
-- types (migration 0170: the same steps, with plans kept for the session).
-- $1 the query's keys (ascending), $2 for each whether it is exclusive, $3
-- the item's tags.
SELECT head, position, type, tags, data, metadata
FROM pgonce.events_decide_tag_item($1, $2, $3)
