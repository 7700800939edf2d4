-- A standard receive's pick, as a function whose plan PostgreSQL keeps.
--
-- Inline in the receive statement, the pick's `LIMIT $2` made the plan
-- depend on the batch size: a generic plan cannot know the limit and
-- assumes a tenth of the matching rows, so as soon as a queue in the table
-- held a backlog of a few thousand, the generic plan cost more than a plan
-- made for the call's own limit, and PostgreSQL planned the whole receive
-- at every call. On PostgreSQL 15, a receive of one from a queue of 5,000
-- spent 0.27 ms planning for 0.07 ms of work. Here the pick is one
-- function call with a fixed cost and row estimate, the same under both
-- plan modes, so the receive's plan is kept; and the function's own query
-- is pinned to the plan it must have whatever the statistics say:
--
-- * `plan_cache_mode = force_generic_plan`: planned once per session, not
--   once per call.
-- * bitmap scans, sequential scans and sorts off: the only plan left is
--   the ordered walk of queue_message_visible, which stops after the
--   messages it takes. On statistics taken while the queue was small, a
--   plan made for a known limit read every visible message and sorted
--   them (measured: 4,720 rows read for 10).
--
-- The settings hold only while the function runs. VOLATILE because it
-- locks (FOR UPDATE SKIP LOCKED): its query takes a snapshot of its own,
-- a little newer than the receive statement's. A message that snapshot
-- sees and the statement's does not (sent in between) is locked but not
-- updated, so it is not delivered and stays visible for the next receive.
-- A message changed in between is locked in its newest version, which is
-- what the statement's updates then act on (READ COMMITTED re-reads a row
-- changed since its snapshot before updating it), and no other receive
-- can change it while the lock is held.
CREATE FUNCTION pgonce.queue_pick_standard(
    queue_name text,
    wanted bigint,
    passed_over bigint[]
) RETURNS TABLE (
    id bigint,
    group_id text,
    visible_at timestamptz,
    sent_at timestamptz,
    receive_count integer,
    receive_base integer
)
LANGUAGE plpgsql VOLATILE ROWS 10
SET plan_cache_mode = force_generic_plan
SET enable_bitmapscan = off
SET enable_seqscan = off
SET enable_sort = off
AS $$
BEGIN
    RETURN QUERY
    SELECT m.id, m.group_id, m.visible_at, m.sent_at, m.receive_count, m.receive_base
    FROM pgonce.queue_message m
    WHERE m.queue = queue_name AND m.visible_at <= now() AND m.id <> ALL(passed_over)
    ORDER BY m.visible_at, m.id
    LIMIT wanted
    FOR UPDATE SKIP LOCKED;
END;
$$;

COMMENT ON FUNCTION pgonce.queue_pick_standard(text, bigint, bigint[]) IS
    'A standard receive''s pick (pick_standard.sql): up to `wanted` visible messages of the queue, earliest first, not in `passed_over`, locked, skipping those another receiver holds.';
