-- A whole append under a lock strategy in one statement (migration 0110):
-- run outside any explicit transaction, it is its own transaction, so
-- locks, condition check, insert and commit take one round trip.
-- $1 events (JSON array), $2 NOTIFY channel or NULL, $3 keys (ascending),
-- $4 for each key whether it is exclusive, $5 table lock, $6 whether a
-- condition is checked, $7 its items (JSON, NULL = every event), $8 after.
SELECT matching, positions
FROM pgonce.events_append($1, $2, $3, $4, $5, $6, $7, $8)
