-- Tags table against the GIN on the array: two copies of the event log side by side,
-- ga (pgonce's shape: tags text[] under a GIN, fastupdate off) and bt (the same
-- events, their tags in a table of their own under a B-tree on (tag, position)).
-- 500,000 events on 5,000 tags (100 each). psql -f tags_table_schema.sql
DROP SCHEMA IF EXISTS ga CASCADE; DROP SCHEMA IF EXISTS bt CASCADE;
CREATE SCHEMA ga; CREATE SCHEMA bt;
-- ga: pgonce's shape, tags as an array under a GIN.
CREATE TABLE ga.events (
    position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    type text NOT NULL, tags text[] NOT NULL DEFAULT '{}',
    data jsonb NOT NULL DEFAULT 'null', metadata jsonb NOT NULL DEFAULT '{}',
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(), recorded_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX ON ga.events USING gin (tags) WITH (fastupdate = off);
CREATE INDEX ON ga.events (type, position);
-- bt: the same events, tags in a table of their own under a B-tree.
CREATE TABLE bt.events (
    position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    type text NOT NULL, tags text[] NOT NULL DEFAULT '{}',
    data jsonb NOT NULL DEFAULT 'null', metadata jsonb NOT NULL DEFAULT '{}',
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(), recorded_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX ON bt.events (type, position);
CREATE TABLE bt.event_tags (tag text NOT NULL, position bigint NOT NULL, PRIMARY KEY (tag, position));
INSERT INTO ga.events (type, tags, data) SELECT 'Booked', ARRAY['t' || (i % 5000)], 'null' FROM generate_series(1, 500000) i;
INSERT INTO bt.events (type, tags, data) SELECT 'Booked', ARRAY['t' || (i % 5000)], 'null' FROM generate_series(1, 500000) i;
INSERT INTO bt.event_tags SELECT tags[1], position FROM bt.events;
VACUUM ANALYZE ga.events; VACUUM ANALYZE bt.events; VACUUM ANALYZE bt.event_tags;
