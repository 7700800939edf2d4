-- A lease or hold naming a transaction id no server ever hands out is
-- lost, not a retry.
--
-- Migration 0230 made an id "in the future" a lost lease: pg_xact_status
-- raises for it. But pg_xact_status checks that only for a normal id: an
-- id whose low 32 bits are 0, 1 or 2 (PostgreSQL's invalid, bootstrap and
-- frozen ids, which no epoch hands out: the 64-bit counter skips them)
-- is answered for the special id itself, NULL or committed, however far
-- past the server's counter its epoch is. A lease rebuilt with such an id
-- (2^32, or i64::MIN, which is 2^63 as an xid8) was not visible in any
-- snapshot and not "in the future", so every fenced write under it raised
-- 40001, and every retry again, forever. No transaction took such a
-- lease, and none can commit it: the lease is lost. A negative id is
-- 2^63 or more as an xid8, past any counter: lost too. The body repeats
-- 0250's but for that test, first.
CREATE OR REPLACE FUNCTION pgonce.fence_lost(taken_in bigint, resource text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    taker text;
BEGIN
    IF taken_in < 0 OR taken_in % 4294967296 < 3 THEN
        -- No server hands this id out: no transaction took this lease.
        RETURN false;
    END IF;
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
