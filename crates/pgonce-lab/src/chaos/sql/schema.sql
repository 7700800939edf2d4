-- The tables the chaos scenarios write their effects to, each row tagged
-- with its round's scope and the history operation that wrote it, so the
-- checker can look at one round and tell which operation wrote what. In
-- `public` explicitly: the role may be named like the `pgonce` schema.
CREATE TABLE IF NOT EXISTS public.chaos_incident (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope     text        NOT NULL,
    entity    text        NOT NULL,
    op        bigint      NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    closed_at timestamptz
);
CREATE INDEX IF NOT EXISTS chaos_incident_scope ON public.chaos_incident (scope, entity);
CREATE TABLE IF NOT EXISTS public.chaos_numbered (
    scope  text   NOT NULL,
    number bigint NOT NULL,
    op     bigint NOT NULL,
    UNIQUE (scope, number)
);
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
