-- The numbered table of `bench sequence` (standing for `incidents`, with its
-- unique index on (organization, number)) and the declaration's other work.
-- In `public` explicitly: the role may be named like the `pgonce` schema.
CREATE TABLE IF NOT EXISTS public.bench_seq_incidents (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org    bigint NOT NULL,
    number bigint NOT NULL,
    UNIQUE (org, number)
);
CREATE TABLE IF NOT EXISTS public.bench_seq_work (
    org  bigint NOT NULL,
    what text   NOT NULL
);
