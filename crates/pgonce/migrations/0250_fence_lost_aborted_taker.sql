-- A lease or hold whose taking transaction rolled back is lost, not a
-- retry.
--
-- pgonce.fence_lost (migrations 0200, 0230) raises 40001 for a taken_in
-- its caller's snapshot cannot see: the transaction that took the lease
-- is newer than the snapshot, or still running, and a fresh snapshot may
-- see the lease. A snapshot taken while that transaction was open cannot
-- see it end, whether it committed or rolled back. Rolled back, it never
-- gave anyone the lease: its token was never committed, and no later
-- transaction writes that token (each lease's is a fresh random uuid). The
-- retry's only answer was that the lease is lost, after one needless 40001
-- that aborted the caller's transaction. pg_xact_status, already asked
-- on this path, says 'aborted' for such a transaction (one open when the
-- server crashed included), and that is final: false now, the lease lost.
CREATE OR REPLACE FUNCTION pgonce.fence_lost(taken_in bigint, resource text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    taker text;
BEGIN
    IF taken_in <> coalesce(pg_current_xact_id_if_assigned()::text::bigint, 0)
       AND NOT pg_visible_in_snapshot(taken_in::text::xid8, pg_current_snapshot()) THEN
        BEGIN
            taker := pg_xact_status(taken_in::text::xid8);
        EXCEPTION WHEN invalid_parameter_value THEN
            -- In the future: no transaction took this lease.
            RETURN false;
        END;
        IF taker = 'aborted' THEN
            -- Rolled back: the lease was never anyone's.
            RETURN false;
        END IF;
        RAISE EXCEPTION 'could not serialize access: this transaction''s snapshot predates % (taken by transaction %)',
            resource, taken_in
            USING ERRCODE = 'serialization_failure',
                  HINT = 'Retry the transaction: a fresh snapshot sees the lease.';
    END IF;
    RETURN false;
END
$$;
