-- The decision read in one statement (migration 0110), its own transaction:
-- $1 the query's keys (ascending), $2 for each whether it is exclusive, $3
-- the query's items (JSON, NULL = every event). The rows of decide.sql.
SELECT head, position, type, tags, data, metadata
FROM pgonce.events_decide($1, $2, $3)
