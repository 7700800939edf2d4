-- The catch-up reader's own transaction id, taken after its snapshot: every
-- append that could still fill a gap the snapshot shows has a lower id.
SELECT pg_current_xact_id()::text::bigint
