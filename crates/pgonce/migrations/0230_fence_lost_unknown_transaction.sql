-- A lease or hold naming a transaction the server has not reached is lost,
-- not a retry.
--
-- pgonce.fence_lost (migration 0200) raised 40001 for any taken_in its
-- caller's snapshot cannot see, meaning "the transaction that took the
-- lease is newer than this snapshot, or still running: retry". A
-- transaction id the server has not handed out yet is not visible in any
-- snapshot either, and no lease was ever taken by it: a claim committed
-- with synchronous_commit = off and lost in a crash (recovery may hand its id
-- out again later), or a lease rebuilt with a wrong id. Every retry asked
-- for another, until the server's counter passed that id: on a quiet
-- server, never. pg_xact_status raises invalid_parameter_value for an id
-- "in the future"; such an id is now a lost lease (false). The exception
-- block, a subtransaction, runs only on this rare path: a fenced write
-- that matched nothing under a snapshot that cannot see the lease's
-- transaction.
CREATE OR REPLACE FUNCTION pgonce.fence_lost(taken_in bigint, resource text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF taken_in <> coalesce(pg_current_xact_id_if_assigned()::text::bigint, 0)
       AND NOT pg_visible_in_snapshot(taken_in::text::xid8, pg_current_snapshot()) THEN
        BEGIN
            PERFORM pg_xact_status(taken_in::text::xid8);
        EXCEPTION WHEN invalid_parameter_value THEN
            -- In the future: no transaction took this lease.
            RETURN false;
        END;
        RAISE EXCEPTION 'could not serialize access: this transaction''s snapshot predates % (taken by transaction %)',
            resource, taken_in
            USING ERRCODE = 'serialization_failure',
                  HINT = 'Retry the transaction: a fresh snapshot sees the lease.';
    END IF;
    RETURN false;
END
$$;
