-- The incident service's schema (seed 000). Versions 1001+ are the
-- service's; the library's are 1-999.
CREATE SCHEMA IF NOT EXISTS incidents;

CREATE TABLE incidents.organizations (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name       text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Something policies are evaluated against (a service, a host, a dataset).
-- `singleton_incidents` is run-time state that per-entity policies consult.
CREATE TABLE incidents.entities (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    organization_id     bigint NOT NULL REFERENCES incidents.organizations (id),
    external_id         text NOT NULL,
    singleton_incidents boolean NOT NULL DEFAULT false,
    created_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (organization_id, external_id)
);

-- singleton: whether the policy allows at most one OPEN incident per entity:
--   never      any number may be open;
--   always     at most one (invariant I1);
--   per_entity at most one iff the entity's singleton_incidents is true at
--              the moment of the write (run-time state: no static index can
--              say it).
CREATE TABLE incidents.policies (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    organization_id bigint NOT NULL REFERENCES incidents.organizations (id),
    name            text NOT NULL,
    singleton       text NOT NULL CHECK (singleton IN ('never', 'always', 'per_entity')),
    created_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (organization_id, name)
);

-- Lifecycle: OPEN -> ACKNOWLEDGED -> RESOLVED, or OPEN -> RESOLVED.
CREATE TABLE incidents.incidents (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    organization_id bigint NOT NULL REFERENCES incidents.organizations (id),
    policy_id       bigint NOT NULL REFERENCES incidents.policies (id),
    entity_id       bigint NOT NULL REFERENCES incidents.entities (id),
    lifecycle       text NOT NULL DEFAULT 'OPEN'
                    CHECK (lifecycle IN ('OPEN', 'ACKNOWLEDGED', 'RESOLVED')),
    summary         text NOT NULL DEFAULT '',
    opened_at       timestamptz NOT NULL DEFAULT now(),
    acknowledged_at timestamptz,
    resolved_at     timestamptz,
    CHECK ((lifecycle = 'RESOLVED') = (resolved_at IS NOT NULL))
);

-- The guarded re-read: open incidents of one (policy, entity).
CREATE INDEX incidents_open_by_policy_entity
    ON incidents.incidents (policy_id, entity_id) WHERE lifecycle = 'OPEN';
