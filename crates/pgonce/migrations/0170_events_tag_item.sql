-- The one-statement append and decision read (migration 0110) for the
-- commonest DCB query: one item naming tags and no types, such as "every
-- event of booking 42". Same steps, same order, same snapshots as
-- pgonce.events_append and pgonce.events_decide; what changes is how the
-- statements inside are planned.
--
-- Those functions build the query as text and EXECUTE it, so PostgreSQL
-- parses and plans it at every call: with `perf` on the server, parsing
-- and planning were about a fifth of the CPU of a decision read plus an
-- append, and the two together ran at 0.38 of a bare SELECT + INSERT
-- doing the same reads and writes (pgbench, 16 clients). Here the tags
-- are parameters of static statements, whose plans PL/pgSQL keeps for the
-- session, each written so that its one plan is right for every value,
-- not only for the values it was first planned with:
--
-- * `plan_cache_mode = force_generic_plan`: planned once per session.
-- * `enable_seqscan = off`: a plan made while the table was small must not
--   stay a sequential scan once it has grown.
-- * The decision read has no `after`: the tag's events through the GIN on
--   `tags`, which is what a plan made for any tag would read; the head
--   through the primary key.
-- * The condition check near the head (`after` at most 512 below it, the
--   head being the primary key's last entry, one index probe): the events
--   above `after` in position order through the primary key, stopping at
--   the 16th match, so at most 512 rows read (and what was appended
--   since). The tag test is written `(...) IS TRUE`, which the GIN cannot
--   answer, so this walk is the only plan. The test is `after >= head -
--   512`, which no `after` overflows.
-- * Further below the head the cheapest plan depends on the tag (its
--   history through the GIN, or the walk when the tag is common), so that
--   check is planned for its values at each call, as migration 0110 does:
--   a plan kept for every tag read a common tag's whole history (40 ms at
--   300,000 events, against 1 ms).
-- * Items with types stay on migration 0110's path: a kept plan cannot use
--   the (type, position) index for a rare type on a common tag, and read
--   the tag's whole history where 0110's plan reads the type's events.
-- * The isolation check and the locks are one call (events_enter) rather
--   than two (events_require_read_committed, events_lock): each call is one
--   more statement for PL/pgSQL to run.
--
-- item_tags: the item's tags (at least one).

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
            ORDER BY e.position
            LIMIT 16);
    ELSE
        -- Planned for these values (EXECUTE ... USING), as 0110's check.
        EXECUTE 'SELECT ARRAY(SELECT e.position FROM pgonce.events e
                              WHERE e.tags @> $1 AND e.position > $2
                              ORDER BY e.position LIMIT 16)'
            INTO matching
            USING item_tags, after;
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
    item_tags text[]
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
        ) AS e ON true
        ORDER BY e.position;
END
$$;
