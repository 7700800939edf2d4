-- counter-row: the scope's counter row in pgonce.sequence_counters, created
-- on first use from the table's max + 1 (so a table with numbers already in
-- it is adopted), else incremented. The row lock taken by the upsert is held
-- until the transaction ends; a rollback undoes the increment.
-- $1 sequence name, $2 scope as text, $3 scope as the column's type.
INSERT INTO pgonce.sequence_counters AS c (sequence, scope, last_number)
SELECT $1, $2, (COALESCE(max({number}), 0) + 1)::bigint FROM {table} WHERE {scope} = $3
ON CONFLICT (sequence, scope) DO UPDATE SET last_number = c.last_number + 1
RETURNING c.last_number
