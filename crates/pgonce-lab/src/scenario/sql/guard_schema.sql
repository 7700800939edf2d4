-- The guard scenario's incidents: one row per incident an entity ever had,
-- tagged with the run's scope and the operation that opened it (a chaos
-- history's op id; a worker's number elsewhere), OPEN while `closed_at` is
-- NULL. Both instants come from clock_timestamp(), so I1 is checked over
-- the whole history, not only the end state. In `public` explicitly: the
-- role may be named like the `pgonce` schema.
CREATE TABLE IF NOT EXISTS public.guard_incident (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope     text        NOT NULL,
    entity    text        NOT NULL,
    op        bigint      NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    closed_at timestamptz
);
-- The overlap check walks each entity's incidents by opening time.
CREATE INDEX IF NOT EXISTS guard_incident_history
    ON public.guard_incident (scope, entity, opened_at);
-- The read set: an entity's OPEN incidents, however long its history.
CREATE INDEX IF NOT EXISTS guard_incident_open
    ON public.guard_incident (scope, entity) WHERE closed_at IS NULL;
