-- Wakes the receivers parked on queue $2 ($1: the channel they LISTEN on),
-- in a transaction of its own (no transaction id: no WAL flush at commit).
SELECT pg_notify($1, $2)
