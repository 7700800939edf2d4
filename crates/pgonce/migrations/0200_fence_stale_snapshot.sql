-- A fenced write that matched nothing under a snapshot older than the
-- lease it was given: a retry, not a lost lease.
--
-- Completing, failing or heartbeating a job's lease, finishing or
-- releasing an idempotency key's hold, is an UPDATE or DELETE that matches
-- the row only while it still carries the lease's token. Under REPEATABLE
-- READ or SERIALIZABLE the statement reads the row as the transaction's
-- snapshot shows it. A transaction that took its snapshot before the lease
-- was taken (a request-scoped transaction begun before `dedupe::acquire`,
-- which runs on its own connection; a job claimed on the pool after the
-- work's transaction began) cannot see the token: the row is pending, or
-- not there at all, or carries a previous holder's token. PostgreSQL raises
-- no serialization failure for a row the statement did not match, so the
-- write matched nothing and the caller was told the lease was lost, gave
-- the work up, and left the job or key held by nobody until the lease ran
-- out.
--
-- Each lease now carries the transaction that took it (its 64-bit id,
-- `pg_current_xact_id()`). When the fenced write matches nothing, the
-- statement calls this function: if the caller's snapshot cannot see that
-- transaction (and it is not the caller's own), it raises 40001, which
-- aborts the caller's transaction like any serialization failure. Run again,
-- the transaction's fresh snapshot sees the lease: the write applies, or it
-- matches nothing because the lease really is lost, and then the function
-- returns false and the caller hears `LeaseLost`. A lost lease therefore
-- never turns into an endless retry.
--
-- Under READ COMMITTED each statement of this function takes a fresh
-- snapshot, which sees every transaction that has ended: the function
-- raises only for a lease used before the transaction that took it
-- committed (the committed row does not carry its token yet, so the write
-- matched nothing and waited for nothing). That transaction may still
-- commit or roll back, so a retry is the answer there too. A taken_in of
-- 0 (unknown) is older than any snapshot: false.
--
-- It only ever returns false (or raises), so a statement can filter on it.
CREATE FUNCTION pgonce.fence_lost(taken_in bigint, resource text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF taken_in <> coalesce(pg_current_xact_id_if_assigned()::text::bigint, 0)
       AND NOT pg_visible_in_snapshot(taken_in::text::xid8, pg_current_snapshot()) THEN
        RAISE EXCEPTION 'could not serialize access: this transaction''s snapshot predates % (taken by transaction %)',
            resource, taken_in
            USING ERRCODE = 'serialization_failure',
                  HINT = 'Retry the transaction: a fresh snapshot sees the lease.';
    END IF;
    RETURN false;
END
$$;
