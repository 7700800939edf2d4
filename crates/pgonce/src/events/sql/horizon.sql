-- The catch-up reader's view in its snapshot: the oldest transaction still
-- running (xmin), one past the last transaction that ended (xmax), and the
-- visible positions after $1. Run first in a REPEATABLE READ transaction,
-- so the events read next share the snapshot.
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax,
       ARRAY(SELECT position FROM pgonce.events
             WHERE position > $1 ORDER BY position LIMIT $2) AS positions
