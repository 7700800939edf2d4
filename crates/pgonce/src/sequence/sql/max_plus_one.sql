-- The next number of scope $1. Correct only when this statement's snapshot
-- is taken after the scope's lock was granted: READ COMMITTED, in a statement
-- of its own after the lock statement.
SELECT (COALESCE(max({number}), 0) + 1)::bigint FROM {table} WHERE {scope} = $1
