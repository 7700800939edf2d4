-- The condition check and the insert in one statement (one round trip): the
-- events are inserted (pgonce.events_insert, migration 0090) only if no event
-- after $1 matches the condition's query; the first matching positions are
-- returned either way. One statement, one snapshot for the check: under READ
-- COMMITTED it is taken when this statement starts, after begin_locked.sql
-- granted every lock, so it sees every append those locks waited for.
-- Nothing is inserted (no position drawn) on a match.
--
-- $1: after (0 without one); $2: a JSON array of {type, tags, data,
-- metadata}, inserted in that order; $3: the NOTIFY channel or NULL (the
-- NOTIFY, carrying the last position, is delivered only on commit); $4:
-- whether the insert reads the conditional appends above its positions (the
-- serializable strategy, see events.rs). The rows are marked conditional.
-- The filter is built from placeholders only (query.rs), from $5 on.
-- The position bound is on `e.position`, or under SERIALIZABLE on
-- `e.position + 0`, which keeps the planner off the primary key: a range
-- scan on `position > $1` near the head would take an SIREAD lock on the
-- key's right-edge page, where every append inserts, and turn disjoint
-- appends into serialization failures; probing the GIN (tags) or (type,
-- position) index instead locks only the query's own keys.
SELECT c.matching,
       CASE WHEN cardinality(c.matching) = 0
            THEN pgonce.events_insert($2, $3, true, $4)
            ELSE '{}'
       END AS positions
FROM (
    SELECT ARRAY(
        SELECT position FROM pgonce.events e
        WHERE ({filter}) AND {position} > $1
        ORDER BY e.position
        LIMIT 16
    ) AS matching
    OFFSET 0 -- keeps the check from being inlined into both uses of c.matching
) AS c
