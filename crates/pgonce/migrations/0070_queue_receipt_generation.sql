-- Receipts of the PostgreSQL queue name one delivery of one message in one
-- queue: `<queue>:<id>:<generation>`. receive_count cannot fence them: a
-- dead-letter move and a redrive leave it unchanged, so a receipt from
-- before either still matched the message in its new queue.
-- Receipts handed out before this migration (`<id>.<count>`) are refused as
-- stale afterwards: their messages come back when their visibility timeout
-- runs out, as after any lost receipt.
ALTER TABLE pgonce.queue_message ADD COLUMN generation bigint NOT NULL DEFAULT 0;

COMMENT ON COLUMN pgonce.queue_message.generation IS
    'Bumped by every receive, dead-letter move and redrive: a receipt acts on the message only while its queue and generation are the ones it was issued with.';
COMMENT ON COLUMN pgonce.queue_message.receive_count IS
    'Deliveries so far; the dead-letter rule counts receive_count - receive_base. Receipts fence on generation, not on this.';
