-- Incidents of `pgonce bench guard`, one chain per entity: every incident
-- records the latest incident its creator saw (`prev`, 0 for none). A
-- correct history is one chain per entity; two incidents with the same
-- (entity, prev) are two creations made on the same state: a violation.
DROP TABLE IF EXISTS bench_guard_incidents;
CREATE TABLE bench_guard_incidents (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    entity integer NOT NULL,
    prev   bigint NOT NULL,
    open   boolean NOT NULL DEFAULT true
);
CREATE INDEX bench_guard_incidents_latest ON bench_guard_incidents (entity, id DESC);
