-- The PostgreSQL queue (pgonce::queue): named queues with SQS semantics.

-- One row per named queue: its kind and attributes. Durations in milliseconds.
CREATE TABLE pgonce.queue (
    name                  text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9_.-]{1,80}$'),
    fifo                  boolean NOT NULL,
    visibility_timeout_ms bigint  NOT NULL CHECK (visibility_timeout_ms >= 0),
    retention_ms          bigint  NOT NULL CHECK (retention_ms > 0),
    delay_ms              bigint  NOT NULL CHECK (delay_ms >= 0),
    -- Receives after which the next receive moves the message to
    -- dead_letter_queue instead; both NULL or both set.
    max_receive_count     integer CHECK (max_receive_count > 0),
    dead_letter_queue     text REFERENCES pgonce.queue (name),
    dedup_window_ms       bigint  NOT NULL CHECK (dedup_window_ms >= 0),
    content_based_dedup   boolean NOT NULL DEFAULT false,
    created_at            timestamptz NOT NULL DEFAULT now(),
    CHECK ((max_receive_count IS NULL) = (dead_letter_queue IS NULL)),
    CHECK (dead_letter_queue IS DISTINCT FROM name)
);

-- Every message of every queue. A message moved to a dead-letter queue keeps
-- its row (and id): only `queue` changes, and `history` records the move.
CREATE TABLE pgonce.queue_message (
    id                 bigserial PRIMARY KEY,
    queue              text NOT NULL REFERENCES pgonce.queue (name) ON DELETE CASCADE,
    body               text NOT NULL,
    attributes         jsonb NOT NULL DEFAULT '{}',
    group_id           text,
    dedup_id           text,
    sent_at            timestamptz NOT NULL DEFAULT now(),
    -- Receivable when visible_at <= now(): delivery delay, then each
    -- receive pushes it forward by the visibility timeout.
    visible_at         timestamptz NOT NULL,
    -- Fencing token: a receipt carries the count it was issued at, and
    -- deletes or extends only while the count is unchanged.
    receive_count      integer NOT NULL DEFAULT 0,
    -- receive_count when last redriven: the dead-letter rule counts
    -- receive_count - receive_base, while receipts keep fencing on the total.
    receive_base       integer NOT NULL DEFAULT 0,
    first_received_at  timestamptz,
    -- The queue a dead-lettered message came from (where redrive sends it).
    dead_lettered_from text,
    history            jsonb NOT NULL DEFAULT '[]'
);

-- Standard receives: the earliest visible messages of a queue.
CREATE INDEX queue_message_visible ON pgonce.queue_message (queue, visible_at, id);
-- FIFO receives: "is there an earlier message in this group?".
CREATE INDEX queue_message_group ON pgonce.queue_message (queue, group_id, id)
    WHERE group_id IS NOT NULL;

-- Deduplication ids seen within each queue's window; outlives the message,
-- as in SQS, so a resend after delete within the window is still a duplicate.
CREATE TABLE pgonce.queue_dedup (
    queue      text NOT NULL REFERENCES pgonce.queue (name) ON DELETE CASCADE,
    dedup_id   text NOT NULL,
    message_id bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (queue, dedup_id)
);
