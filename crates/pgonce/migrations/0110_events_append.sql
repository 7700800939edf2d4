-- A whole append under the lock strategies (advisory locks, table lock) in
-- one statement, so that the client can run it in one round trip as its own
-- (implicit) transaction: locks, condition check, insert, commit.
--
-- Why it is as safe as the three messages it replaces (begin_locked.sql,
-- insert_checked.sql, COMMIT):
--
-- * The locks are taken first, in the order given (ascending keys, sorted
--   by the caller), each exclusive or shared as `exclusive` says; then, for
--   the table-lock strategy, the table in EXCLUSIVE mode; then the
--   transaction id is assigned, before any position is drawn (the catch-up
--   horizon relies on it).
-- * The check runs after every lock was granted, with its own snapshot: in
--   a READ COMMITTED transaction every SQL statement a VOLATILE PL/pgSQL
--   function runs takes a new snapshot, so the check sees every append the
--   locks waited for (the snapshot of the calling statement, taken before
--   the locks, is not used for it).
-- * The check is planned for its values (EXECUTE plans each time, with the
--   values written in by format's %L, which quotes them as literals): the
--   condition needs the plan made for its `after` (primary key near the
--   head, the GIN or the type index far from it), as insert_checked.sql
--   does by being re-planned.
-- * Nothing is inserted (no position drawn) when an event matches; the
--   first matching positions are returned either way.
--
-- Only READ COMMITTED: the serializable strategy keeps its own path
-- (begin_locked.sql, insert_checked.sql), since the isolation of an
-- implicit transaction cannot be chosen by the statement that runs in it.
--
-- events: a JSON array of {type, tags, data, metadata}; channel: NOTIFY
-- channel or NULL; keys/exclusive: the advisory keys and their modes;
-- table_lock: take the table lock; checked: whether a condition is checked;
-- items: the condition's query items, a JSON array of {types, tags} (NULL:
-- match every event); after: the condition's position (0 without one).
-- The WHERE fragment over `pgonce.events e` for a query given as a JSON
-- array of items {types, tags} (NULL: every event), with the values written
-- in as quoted literals (format's %L), for EXECUTE. An item is
-- (tags @> its tags AND type = ANY(its types)), leaving out the half it does
-- not constrain; items are OR-ed: the fragment events/query.rs builds with
-- placeholders, so the same indexes answer it (GIN on tags, B-tree on
-- (type, position), a BitmapOr for several items).
CREATE FUNCTION pgonce.events_filter(items jsonb)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN items IS NULL THEN 'TRUE' ELSE (
        SELECT string_agg(
                   '(' || concat_ws(' AND ',
                       CASE WHEN jsonb_array_length(i->'tags') > 0
                            THEN format('e.tags @> %L::text[]',
                                        ARRAY(SELECT jsonb_array_elements_text(i->'tags')))
                       END,
                       CASE WHEN jsonb_array_length(i->'types') > 0
                            THEN format('e.type = ANY(%L::text[])',
                                        ARRAY(SELECT jsonb_array_elements_text(i->'types')))
                       END) || ')',
                   ' OR ' ORDER BY n)
        FROM jsonb_array_elements(items) WITH ORDINALITY AS t(i, n)
    ) END
$$;

-- Refuses (SQLSTATE PO110, before anything is done) to run the functions
-- below in a transaction that is not READ COMMITTED: their checks and reads
-- rely on each statement taking a fresh snapshot after the locks. pgonce
-- then takes its transaction path, which sets the isolation itself.
CREATE FUNCTION pgonce.events_require_read_committed()
RETURNS void
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pgonce.events_append and events_decide run under READ COMMITTED only, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'PO110';
    END IF;
END
$$;

-- Takes advisory keys in the order given, each exclusive or shared.
CREATE FUNCTION pgonce.events_lock(keys bigint[], exclusive boolean[])
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM CASE WHEN x THEN (SELECT 1 FROM pg_advisory_xact_lock(k))
                 ELSE (SELECT 1 FROM pg_advisory_xact_lock_shared(k)) END
    FROM unnest(keys, exclusive) WITH ORDINALITY AS t(k, x, n)
    ORDER BY n;
END
$$;

CREATE FUNCTION pgonce.events_append(
    events jsonb,
    channel text,
    keys bigint[],
    exclusive boolean[],
    table_lock boolean,
    checked boolean,
    items jsonb,
    after bigint,
    OUT matching bigint[],
    OUT positions bigint[]
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    filter text;
BEGIN
    PERFORM pgonce.events_require_read_committed();
    PERFORM pgonce.events_lock(keys, exclusive);
    IF table_lock THEN
        LOCK TABLE pgonce.events IN EXCLUSIVE MODE;
    END IF;
    PERFORM pg_current_xact_id();
    matching := '{}';
    IF checked THEN
        filter := pgonce.events_filter(items);
        EXECUTE format(
            'SELECT ARRAY(SELECT e.position FROM pgonce.events e
                          WHERE (%s) AND e.position > $1
                          ORDER BY e.position LIMIT 16)', filter)
        INTO matching
        USING after;
    END IF;
    IF cardinality(matching) = 0 THEN
        positions := pgonce.events_insert(events, channel, checked, false);
    ELSE
        positions := '{}';
    END IF;
END
$$;

-- The decision read in one statement (one round trip, its own implicit
-- transaction): takes the query's keys (exclusive, ascending, as the caller
-- sorted them), which waits for every in-flight append publishing a
-- matching event, then returns the head and the matching events from one
-- snapshot taken after the locks were granted (the one statement EXECUTE
-- runs; events/sql/decide.sql is the same read). No transaction id is
-- assigned: the transaction commits without a WAL flush. One row with NULL
-- event columns when nothing matches.
CREATE FUNCTION pgonce.events_decide(keys bigint[], exclusive boolean[], items jsonb)
RETURNS TABLE (head bigint, "position" bigint, type text, tags text[], data jsonb, metadata jsonb)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pgonce.events_require_read_committed();
    PERFORM pgonce.events_lock(keys, exclusive);
    RETURN QUERY EXECUTE format(
        'SELECT h.head, e.position, e.type, e.tags, e.data, e.metadata
         FROM (SELECT max(position) AS head FROM pgonce.events) AS h
         LEFT JOIN LATERAL (
             SELECT position, type, tags, data, metadata FROM pgonce.events e
             WHERE (%s)
         ) AS e ON true
         ORDER BY e.position', pgonce.events_filter(items));
END
$$;
