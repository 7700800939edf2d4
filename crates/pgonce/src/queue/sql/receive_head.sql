-- Receive, in one statement: pick up to $2 receivable messages of queue $1
-- other than those of $4 (held back or delivered by an earlier statement of
-- the same receive), with FOR UPDATE SKIP LOCKED, so concurrent receivers
-- never get the same one; then per picked message exactly one of: delete
-- it (past retention), move it to the dead-letter queue (received
-- max_receive_count times since it came into this queue), hold it back for
-- a later receive (such a FIFO message whose group in the dead-letter queue
-- a sender has locked), deliver it (receive_count + 1, invisible for $3 ms
-- or the queue's visibility timeout), or leave it untouched: past the
-- first $5 deliveries ('skipped'), or when this statement's snapshot does
-- not see it ('unseen', receive_report.sql). A move and a delivery both bump
-- the generation: every earlier receipt of the message goes stale.
WITH q AS (
    SELECT name, visibility_timeout_ms, retention_ms, max_receive_count, dead_letter_queue
    FROM pgonce.queue WHERE name = $1
