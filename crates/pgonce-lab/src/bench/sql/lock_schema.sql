CREATE TABLE IF NOT EXISTS bench_lock_rows (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    worker int NOT NULL
);
