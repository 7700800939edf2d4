-- The DCB event store (module `events`). One global log; a position is drawn
-- from the identity when the row is inserted and becomes visible when its
-- transaction commits. `xid` is the appending transaction's id, taken before
-- any position is drawn; catch-up readers use it with pg_current_snapshot()
-- to know when a gap below a visible position can no longer fill.
CREATE TABLE pgonce.events (
    position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    type text NOT NULL CHECK (type <> ''),
    tags text[] NOT NULL DEFAULT '{}',
    data jsonb NOT NULL DEFAULT 'null',
    metadata jsonb NOT NULL DEFAULT '{}',
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    recorded_at timestamptz NOT NULL DEFAULT now()
);

-- Tag items (`tags @> $1`): GIN over the tag array answers "carries all of
-- these tags" for any number of tags; fastupdate off keeps append latency
-- flat (no pending list flushed by an unlucky writer) and the condition
-- check exact. See docs/events-indexes.md for the EXPLAIN on 1,000,000 rows.
CREATE INDEX events_tags_gin ON pgonce.events USING gin (tags) WITH (fastupdate = off);

-- Type-only items (`type = ANY($1) AND position > $after`): a B-tree on
-- (type, position) reads only the type's events after `after`, in order.
CREATE INDEX events_type_position ON pgonce.events (type, position);
