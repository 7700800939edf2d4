-- Change visibility by receipt: $1 queue, $2 id, $3 generation of the
-- receipt, $4 new timeout from now, ms. No row: the receipt is stale.
-- By primary key alone, as delete.sql says why.
-- Returns whether the message now becomes visible sooner than it was to
-- (a hand-back, not a heartbeat's extension): a long poll parked until the
-- old time is then woken to look again (postgres.rs, change_visibility).
WITH before AS (
    SELECT visible_at FROM pgonce.queue_message
    WHERE id = $2 AND generation = $3 AND queue IS NOT DISTINCT FROM $1
)
UPDATE pgonce.queue_message
SET visible_at = now() + $4 * interval '1 millisecond'
WHERE id = $2 AND generation = $3 AND queue IS NOT DISTINCT FROM $1
RETURNING coalesce(visible_at < (SELECT visible_at FROM before), false) AS sooner
