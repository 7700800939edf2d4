-- append_tag_item.sql for one event, its fields as parameters (migration
-- 0180). $1 type, $2 tags, $3 data, $4 metadata, $5 NOTIFY channel or
-- NULL, $6 keys (ascending), $7 for each key whether it is exclusive, $8
-- table lock, $9 the item's tags, $10 the condition's after.
SELECT matching, positions
FROM pgonce.events_append_one_tag_item($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
