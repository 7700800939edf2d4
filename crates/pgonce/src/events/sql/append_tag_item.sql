-- append.sql for a condition whose query is one item naming tags and no
-- types (migration 0170: the same steps, with plans kept for the session).
-- $1 events (JSON array), $2 NOTIFY channel or NULL, $3 keys (ascending),
-- $4 for each key whether it is exclusive, $5 table lock, $6 the item's
-- tags, $7 the condition's after.
SELECT matching, positions
FROM pgonce.events_append_tag_item($1, $2, $3, $4, $5, $6, $7)
