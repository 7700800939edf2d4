-- The tables the chaos scenarios write their effects to (the guard and
-- sequence scenarios' rows are in their own tables, public.guard_incident
-- and public.sequence_incident), each row tagged with its round's scope and
-- the history operation that wrote it, so the checker can look at one round
-- and tell which operation wrote what. In `public` explicitly: the role may
-- be named like the `pgonce` schema.
CREATE TABLE IF NOT EXISTS public.chaos_job_effect (
    scope  text   NOT NULL,
    job_id bigint NOT NULL,
    op     bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS public.chaos_key_effect (
    scope text   NOT NULL,
    key   text   NOT NULL,
    op    bigint NOT NULL
);
