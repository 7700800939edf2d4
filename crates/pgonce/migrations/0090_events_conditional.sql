-- Closes a hole of the serializable strategy (module `events`, "Why every
-- append reads the conditional appends above it"): an append that checks no
-- condition reads nothing, so SERIALIZABLE saw only one rw-dependency (from
-- a concurrent conditional append that missed it) and no cycle, and let both
-- commit with the unconditional event below the conditional one.
--
-- `conditional` marks the rows of appends that checked a condition. Under
-- the serializable strategy every append reads the conditional rows above
-- its own lowest position, through the partial index below: a small index
-- (only conditional rows), whose right edge is where every later
-- conditional append inserts, so that read conflicts with exactly the
-- conditional appends drawn after it.
ALTER TABLE pgonce.events ADD COLUMN conditional boolean NOT NULL DEFAULT false;

CREATE INDEX events_conditional ON pgonce.events (position) WHERE conditional;

-- pgonce.events_insert (migration 0061) with two more arguments:
-- `conditional` is stored on every row; with `read_later`, after drawing the
-- positions it reads the conditional rows above the lowest of them (all of
-- them: in a SERIALIZABLE transaction none is visible but its own, since
-- each was drawn after this transaction's snapshot, so the scan runs to the
-- index's right edge and its predicate lock covers every conditional append
-- drawn later). enable_seqscan is off for that read: a sequential scan would
-- take a predicate lock on the whole table and conflict with every append.
-- Returns the positions, ascending.
CREATE FUNCTION pgonce.events_insert(
    events jsonb, channel text, conditional boolean, read_later boolean
)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    positions bigint[];
    later bigint;
BEGIN
    WITH inserted AS (
        INSERT INTO pgonce.events (type, tags, data, metadata, conditional)
        SELECT x.ev->>'type',
               ARRAY(SELECT jsonb_array_elements_text(x.ev->'tags')),
               x.ev->'data',
               x.ev->'metadata',
               events_insert.conditional
        FROM jsonb_array_elements(events) WITH ORDINALITY AS x(ev, n)
        ORDER BY x.n
        RETURNING position
    )
    SELECT array_agg(position ORDER BY position) INTO positions FROM inserted;
    IF read_later AND positions IS NOT NULL THEN
        SELECT count(*) INTO later FROM pgonce.events e
        WHERE e.conditional AND e.position > positions[1];
    END IF;
    IF channel IS NOT NULL AND positions IS NOT NULL THEN
        PERFORM pg_notify(channel, positions[array_upper(positions, 1)]::text);
    END IF;
    RETURN COALESCE(positions, '{}');
END
$$;
