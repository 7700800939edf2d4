-- select-for-update (the seed's first attempt): locks the rows the scope has
-- already. An empty scope has none, so the first declarations of a scope lock
-- nothing and may compute the same number; the unique index then rejects all
-- but one of them. The count keeps the rows on the server.
SELECT count(*) FROM (SELECT 1 FROM {table} WHERE {scope} = $1 FOR UPDATE) AS locked
