-- Wakes the receivers parked on queue $2 ($1: the channel they LISTEN on),
-- in a transaction of its own: it writes no WAL before its commit record,
-- so its commit does not wait for a WAL flush.
SELECT pg_notify($1, $2)
