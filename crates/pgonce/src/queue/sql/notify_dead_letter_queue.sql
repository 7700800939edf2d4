-- Wakes the receivers parked on queue $2's dead-letter queue ($1: the
-- channel they LISTEN on) after a receive moved messages there, in a
-- transaction of its own (notify.sql). The dead-letter queue is read from
-- the queue's row: set_attributes may have changed it since the handle
-- opened, and the receive's statement moved to the one the row named.
SELECT pg_notify($1, dead_letter_queue) FROM pgonce.queue
WHERE name = $2 AND dead_letter_queue IS NOT NULL
