-- The raw limit of `pgonce bench queue`: a bare table, one row per message.
DROP TABLE IF EXISTS bench_queue_raw;
CREATE TABLE bench_queue_raw (
    id   bigserial PRIMARY KEY,
    body text NOT NULL
);

-- The raw at-least-once floor: the same bare table with a visibility time.
-- A consumer leases a row (moves its visible_at past the visibility
-- timeout), then deletes it, so a consumer that dies in between leaves the
-- row to be taken again: the three commits per message that any queue
-- delivering at least once pays, without anything else.
DROP TABLE IF EXISTS bench_queue_raw_lease;
CREATE TABLE bench_queue_raw_lease (
    id         bigserial PRIMARY KEY,
    body       text NOT NULL,
    visible_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ON bench_queue_raw_lease (visible_at, id);
