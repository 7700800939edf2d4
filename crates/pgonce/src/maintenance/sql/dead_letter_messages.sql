-- Up to $2 messages sitting in a dead-letter queue (moved there by the
-- dead-letter rule, not redriven since) sent more than $1 seconds ago, as
-- SQS counts retention from the original send. A message a consumer of the
-- dead-letter queue has in flight (invisible) is left to its visibility
-- timeout; one being received or redriven right now is locked and skipped.
WITH old AS (
    SELECT id FROM pgonce.queue_message
    WHERE dead_lettered_from IS NOT NULL
      AND sent_at < now() - make_interval(secs => $1)
      AND visible_at <= now()
    ORDER BY sent_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM pgonce.queue_message AS m
USING old
WHERE m.id = old.id AND m.dead_lettered_from IS NOT NULL
