-- Per-scope counters for the `counter-row` strategy of the sequence module.
-- One row per (numbered table, scope); `last_number` is the last number
-- handed out in that scope by a committed transaction.
CREATE TABLE pgonce.sequence_counters (
    sequence    text   NOT NULL,
    scope       text   NOT NULL,
    last_number bigint NOT NULL CHECK (last_number > 0),
    PRIMARY KEY (sequence, scope)
);
