-- Dedupe (pattern P4).

-- Processed-message keys: one row per (consumer, message id) whose effect was
-- applied, written in the effect's own transaction. Collected after a
-- retention longer than the queue's redelivery horizon.
CREATE TABLE pgonce.processed_messages (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX processed_messages_age ON pgonce.processed_messages (processed_at);

-- Idempotency keys for requests: the first use holds the key (hold_token,
-- held_until) and records the request's fingerprint; finishing stores the
-- response that retries get back.
CREATE TABLE pgonce.idempotency_keys (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    status       text        NOT NULL DEFAULT 'in_progress'
        CHECK (status IN ('in_progress', 'done')),
    hold_token   uuid,
    held_until   timestamptz,
    response     jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    PRIMARY KEY (scope, key),
    CONSTRAINT idempotency_hold_iff_in_progress CHECK (
        (status = 'in_progress') = (hold_token IS NOT NULL AND held_until IS NOT NULL)
        AND (status = 'done') = (finished_at IS NOT NULL)
    )
);
CREATE INDEX idempotency_keys_age ON pgonce.idempotency_keys (created_at);
