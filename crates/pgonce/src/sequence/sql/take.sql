-- advisory-lock, table-lock, select-for-update: in one round trip, the
-- isolation check, the scope's lock and max(number) + 1 read with a snapshot
-- taken after the lock was granted (see migrations/0060_sequence_take.sql).
-- The names are string constants put in once per sequence, so each table has
-- its own statement text (and its own prepared statement).
-- $1 the scope's advisory lock key, $2 the scope value.
SELECT isolation, number, after_grant
FROM pgonce.sequence_take({strategy}, $1, {schema_name}, {table_name}, {scope_name}, {number_name}, $2)
