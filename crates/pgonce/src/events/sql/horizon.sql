-- The catch-up reader's view in its snapshot: the oldest transaction still
-- running (xmin), the first not yet started (xmax), and the positions after
-- $1 that are visible. Run first in a REPEATABLE READ transaction, so the
-- events read next come from the same snapshot.
SELECT pg_snapshot_xmin(s)::text::bigint AS xmin,
       pg_snapshot_xmax(s)::text::bigint AS xmax,
       ARRAY(SELECT position FROM pgonce.events
             WHERE position > $1 ORDER BY position LIMIT $2) AS positions
FROM pg_current_snapshot() AS s
