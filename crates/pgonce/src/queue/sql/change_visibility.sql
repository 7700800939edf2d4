-- Change visibility by receipt: $1 queue, $2 id, $3 generation of the
-- receipt, $4 new timeout from now, ms, $5 the handle's kind (fifo): the
-- queue must still be of that kind (see delete.sql). No row: the receipt
-- is stale, or the queue is gone.
-- By primary key alone, as delete.sql says why.
-- Returns whether the message now becomes visible sooner than it was to
-- (a hand-back, not a heartbeat's extension): a long poll parked until the
-- old time is then woken to look again (postgres.rs, change_visibility).
WITH before AS (
    -- The old time is read under the row's lock, as the update finds the
    -- row: after waiting for a concurrent change of the same delivery (a
    -- heartbeat), the lock returns the row that change left. Read from
    -- the statement's snapshot instead, it was the time before that
    -- change: a hand-back for less than a heartbeat had just set, but more
    -- than the lease before it, was "not sooner", and a long poll that saw
    -- the heartbeat's time slept past the message (tests/queue.rs,
    -- `a_hand_back_after_a_concurrent_heartbeat_wakes_a_long_poll`). The
    -- update joins it, so the lock is taken first; NO KEY, the lock the
    -- update takes anyway (it changes no key).
    SELECT id, visible_at FROM pgonce.queue_message
    WHERE id = $2 AND generation = $3 AND queue IS NOT DISTINCT FROM $1
      AND EXISTS (SELECT FROM pgonce.queue q WHERE q.name = $1 AND q.fifo = $5)
    FOR NO KEY UPDATE
)
UPDATE pgonce.queue_message m
SET visible_at = now() + $4 * interval '1 millisecond'
FROM before
WHERE m.id = $2 AND m.generation = $3 AND m.queue IS NOT DISTINCT FROM $1 AND m.id = before.id
RETURNING m.visible_at < before.visible_at AS sooner
