-- The type of table $1's number column $3 as PostgreSQL names it
-- (`bigint`, `numeric(5,0)`, a domain's name), NULL when there is no such
-- column. Run beside unique_index.sql, whose parameters it shares.
SELECT format_type(a.atttypid, a.atttypmod)
FROM pg_attribute AS a
WHERE a.attrelid = to_regclass($1)
  AND a.attname = $3
  AND a.attnum > 0
  AND NOT a.attisdropped
