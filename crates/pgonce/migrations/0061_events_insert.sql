-- The event store's insert as a PL/pgSQL function, for the conditional append
-- (events/sql/insert_checked.sql). The condition check needs a plan made for
-- its `after` (the primary key near the head, the GIN or type index far
-- from it), so its statement is planned at every execution; calling the
-- insert from here keeps the INSERT out of that statement, and PL/pgSQL
-- plans the INSERT once per session. Inserts `events` (a JSON array of
-- {type, tags, data, metadata}) in the order given, drawing their positions
-- in that order; with `channel` not NULL, queues a NOTIFY carrying the last
-- position (delivered only on commit). Returns the positions, ascending.
CREATE FUNCTION pgonce.events_insert(events jsonb, channel text)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    positions bigint[];
BEGIN
    WITH inserted AS (
        INSERT INTO pgonce.events (type, tags, data, metadata)
        SELECT x.ev->>'type',
               ARRAY(SELECT jsonb_array_elements_text(x.ev->'tags')),
               x.ev->'data',
               x.ev->'metadata'
        FROM jsonb_array_elements(events) WITH ORDINALITY AS x(ev, n)
        ORDER BY x.n
        RETURNING position
    )
    SELECT array_agg(position ORDER BY position) INTO positions FROM inserted;
    IF channel IS NOT NULL AND positions IS NOT NULL THEN
        PERFORM pg_notify(channel, positions[array_upper(positions, 1)]::text);
    END IF;
    RETURN COALESCE(positions, '{}');
END
$$;
