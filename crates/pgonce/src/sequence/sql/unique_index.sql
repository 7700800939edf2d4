-- Whether a unique index (or unique/primary-key constraint) covers exactly
-- the columns ($2, $3) of table $1, in either order, with no predicate.
SELECT EXISTS (
    SELECT 1
    FROM pg_index AS i
    WHERE i.indrelid = to_regclass($1)
      AND i.indisunique
      AND i.indpred IS NULL
      AND i.indnkeyatts = 2
      AND (SELECT array_agg(a.attname::text ORDER BY a.attname::text)
           FROM pg_attribute AS a
           WHERE a.attrelid = i.indrelid
             AND a.attnum = ANY (i.indkey::int2[])) = (SELECT array_agg(c ORDER BY c) FROM unnest(ARRAY[$2, $3]::text[]) AS c)
)
