-- The raw limit of `pgonce bench queue`: a bare table, one row per message.
DROP TABLE IF EXISTS bench_queue_raw;
CREATE TABLE bench_queue_raw (
    id   bigserial PRIMARY KEY,
    body text NOT NULL
);
