-- A FIFO receive's skip over the groups, as a function.
--
-- pick_fifo.sql walks a queue's oldest messages for its groups' heads and,
-- when those hold too few, skips through the queue's groups for heads
-- newer than the walk's window: per group one index descent to the next
-- group id and one to its first message. Written as a recursive CTE in the
-- receive statement, that skip was costed by the planner whether it ran or
-- not, and under a generic plan far higher than under a custom one (its
-- "next group after this one" had no queue name to estimate with), so
-- PostgreSQL planned the receive at every call: 1 ms of planning per
-- receive, and the FIFO scenario of `pgonce bench queue` fell by a third.
-- Here the skip is one function call with a fixed cost and row estimate,
-- the same under both plans, and its own statements' plans are kept per
-- session.
--
-- It returns, in group order, up to `wanted` first messages of their
-- groups that are visible, newer than `after` and not in `passed_over`,
-- with their row versions (ctid and xmin), which the receive then locks,
-- skipping any another receiver holds or that changed since. The receive
-- asks for more than it delivers, so that receivers running at once, who
-- all get the same candidates in the same order, each find some not yet
-- locked. STABLE: its statements read the receive statement's snapshot,
-- so the heads it finds are those the walk would have found there.
CREATE FUNCTION pgonce.queue_fifo_heads_after(
    queue_name text,
    after bigint,
    wanted bigint,
    passed_over bigint[]
) RETURNS TABLE (id bigint, row_version tid, row_xmin xid)
LANGUAGE plpgsql STABLE ROWS 10
AS $$
DECLARE
    next_group text;
    head record;
BEGIN
    SELECT min(m.group_id) INTO next_group FROM pgonce.queue_message m
    WHERE m.queue = queue_name AND m.group_id IS NOT NULL;
    WHILE next_group IS NOT NULL AND wanted > 0 LOOP
        SELECT m.id, m.ctid, m.xmin, m.visible_at INTO head FROM pgonce.queue_message m
        WHERE m.queue = queue_name AND m.group_id = next_group
        ORDER BY coalesce(m.group_position, m.id)
        LIMIT 1;
        IF head.visible_at <= now() AND head.id > after
           AND head.id <> ALL(passed_over) THEN
            id := head.id;
            row_version := head.ctid;
            row_xmin := head.xmin;
            RETURN NEXT;
            wanted := wanted - 1;
        END IF;
        SELECT min(m.group_id) INTO next_group FROM pgonce.queue_message m
        WHERE m.queue = queue_name AND m.group_id > next_group;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION pgonce.queue_fifo_heads_after(text, bigint, bigint, bigint[]) IS
    'A FIFO receive''s skip over the groups (pick_fifo.sql): up to `wanted` visible group heads newer than `after`, not in `passed_over`, with their row versions.';
