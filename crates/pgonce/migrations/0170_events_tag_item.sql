-- The one-statement append and decision read (migration 0110) for the
-- commonest DCB query: one item naming at least one tag (and maybe types),
-- such as "every event of booking 42". Same steps, same order, same
-- snapshots as pgonce.events_append and pgonce.events_decide; what changes
-- is how the statements inside are planned.
--
-- Those functions build the query as text and EXECUTE it, so PostgreSQL
-- parses and plans it at every call: with `perf` on the server, parsing
-- and planning were about a fifth of the CPU of a decision read plus an
-- append, and the two together ran at 0.38 of a bare SELECT + INSERT
-- doing the same reads and writes (pgbench, 16 clients). Here the
-- query's values are parameters of static statements, whose plans
-- PL/pgSQL keeps for the session; each statement is written so that its
-- one plan is right for every value, not only for the values it was
-- first planned with:
--
-- * `plan_cache_mode = force_generic_plan`: planned once per session.
-- * `enable_seqscan = off`: a plan made while the table was small must not
--   stay a sequential scan once it has grown.
-- * The condition check is one of two statements, chosen by how far the
--   condition's `after` is below the head (the primary key's last entry,
--   one index probe):
--   - near the head (up to 512 positions): the events above `after` in
--     position order, through the primary key, stopping at the 16th
--     match: at most 512 rows read (and what was appended since) however
--     long the tag's history. The tag test is written `(...) IS TRUE`,
--     which the GIN cannot answer, so the walk is the only plan;
--   - further: the tag's events through the GIN on `tags`, then those
--     above `after`: as many rows as the tag has events, the same rows the
--     decision read reads. `OFFSET 0` keeps the order and limit outside,
--     so the planner does not trade the GIN for an ordered walk of the
--     whole primary key (12 ms for a rare tag at 28,000 events).
--   Both statements return the same positions; the choice is only cost.
-- * The decision read has no `after`: the tag's events through the GIN,
--   sorted; the head through the primary key.
-- * The isolation check and the locks are one call (events_enter) rather
--   than two (events_require_read_committed, events_lock): each call is one
--   more statement for PL/pgSQL to run.
--
-- item_tags: the item's tags (at least one); item_types: its types, empty
-- for any.

-- Refuses (SQLSTATE PO110, before anything is done) to run outside READ
-- COMMITTED, as events_require_read_committed does, then takes the keys in
-- the order given, each exclusive or shared.
CREATE FUNCTION pgonce.events_enter(keys bigint[], exclusive boolean[])
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pgonce.events_append_tag_item and events_decide_tag_item run under READ COMMITTED only, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'PO110';
    END IF;
    FOR i IN 1 .. coalesce(cardinality(keys), 0) LOOP
        IF exclusive[i] THEN
            PERFORM pg_advisory_xact_lock(keys[i]);
        ELSE
            PERFORM pg_advisory_xact_lock_shared(keys[i]);
        END IF;
    END LOOP;
END
$$;

CREATE FUNCTION pgonce.events_append_tag_item(
    events jsonb,
    channel text,
    keys bigint[],
    exclusive boolean[],
    table_lock boolean,
    item_tags text[],
    item_types text[],
    after bigint,
    OUT matching bigint[],
    OUT positions bigint[]
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    head bigint;
BEGIN
    PERFORM pgonce.events_enter(keys, exclusive);
    IF table_lock THEN
        LOCK TABLE pgonce.events IN EXCLUSIVE MODE;
    END IF;
    PERFORM pg_current_xact_id();
    SELECT max(e.position) INTO head FROM pgonce.events e;
    -- Written so that no `after`, however low, overflows a bigint.
    IF after >= coalesce(head, 0) - 512 THEN
        matching := ARRAY(
            SELECT e.position FROM pgonce.events e
            WHERE e.position > after
              AND (e.tags @> item_tags) IS TRUE
              AND (cardinality(item_types) = 0 OR e.type = ANY(item_types))
            ORDER BY e.position
            LIMIT 16);
    ELSE
        matching := ARRAY(
            SELECT m.position FROM (
                SELECT e.position FROM pgonce.events e
                WHERE e.tags @> item_tags
                  AND (cardinality(item_types) = 0 OR e.type = ANY(item_types))
                  AND e.position > after
                OFFSET 0
            ) AS m
            ORDER BY m.position
            LIMIT 16);
    END IF;
    IF cardinality(matching) = 0 THEN
        positions := pgonce.events_insert(events, channel, true, false);
    ELSE
        positions := '{}';
    END IF;
END
$$;

CREATE FUNCTION pgonce.events_decide_tag_item(
    keys bigint[],
    exclusive boolean[],
    item_tags text[],
    item_types text[]
)
RETURNS TABLE (head bigint, "position" bigint, type text, tags text[], data jsonb, metadata jsonb)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    PERFORM pgonce.events_enter(keys, exclusive);
    RETURN QUERY
        SELECT h.head, e.position, e.type, e.tags, e.data, e.metadata
        FROM (SELECT max(x.position) AS head FROM pgonce.events x) AS h
        LEFT JOIN LATERAL (
            SELECT x.position, x.type, x.tags, x.data, x.metadata FROM pgonce.events x
            WHERE x.tags @> item_tags
              AND (cardinality(item_types) = 0
                   OR x.type = ANY(item_types))
        ) AS e ON true
        ORDER BY e.position;
END
$$;
