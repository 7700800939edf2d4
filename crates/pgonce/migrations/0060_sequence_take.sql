-- The max + 1 strategies of the sequence module in one round trip: check the
-- isolation level, take the scope's lock, then compute max(number) + 1.
--
-- Why a function: the max must be read with a snapshot taken after the lock
-- was granted. Under READ COMMITTED a plain statement takes its snapshot when
-- it starts, so lock and max in one plain statement would read the max as it
-- was before the wait (a duplicate). A VOLATILE function takes a fresh
-- snapshot for each statement it runs ("VOLATILE functions obtain a fresh
-- snapshot at the start of each query they execute", PostgreSQL docs,
-- "Function Volatility Categories"), so the EXECUTE below sees every number
-- committed by the previous holder of the lock, exactly as a separate
-- statement from the client would, without the client round trip between
-- lock and max: the scope is held for one round trip less.
--
-- Nothing is locked unless the transaction is READ COMMITTED: the function
-- then returns the level it found and a NULL number, and the caller raises
-- its typed error. Locks taken here (advisory, table, rows) are
-- transaction-level: they last until the caller's COMMIT or ROLLBACK.
--
-- after_grant: seconds from the lock being granted to the function's return,
-- so the caller can time how long the scope is held.
CREATE FUNCTION pgonce.sequence_take(
    strategy      text,        -- 'advisory-lock', 'table-lock' or 'select-for-update'
    lock_key      bigint,      -- the scope's advisory lock key (advisory-lock only)
    table_schema  text,
    table_name    text,
    scope_column  text,
    number_column text,
    scope         anyelement,  -- the scope value, in the type the caller binds
    OUT isolation   text,
    OUT number      bigint,
    OUT after_grant double precision
)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    tbl     text := format('%I.%I', table_schema, table_name);
    granted timestamptz;
BEGIN
    isolation := current_setting('transaction_isolation');
    IF isolation <> 'read committed' THEN
        RETURN;
    END IF;
    CASE strategy
    WHEN 'advisory-lock' THEN
        PERFORM pg_advisory_xact_lock(lock_key);
    WHEN 'table-lock' THEN
        -- The sequenced gem: every write to the table, of every scope, waits.
        EXECUTE format('LOCK TABLE %s IN EXCLUSIVE MODE', tbl);
    WHEN 'select-for-update' THEN
        -- The usual first attempt at narrowing the table lock to one scope:
        -- locks the scope's existing rows only.
        EXECUTE format(
            'SELECT count(*) FROM (SELECT 1 FROM %s WHERE %I = $1 FOR UPDATE) AS locked',
            tbl, scope_column)
        USING scope;
    ELSE
        RAISE EXCEPTION 'pgonce.sequence_take: unknown strategy %', strategy
            USING ERRCODE = 'invalid_parameter_value';
    END CASE;
    granted := clock_timestamp();
    -- A statement of its own: its snapshot is taken now, after the lock.
    EXECUTE format(
        'SELECT (COALESCE(max(%I), 0) + 1)::bigint FROM %s WHERE %I = $1',
        number_column, tbl, scope_column)
    INTO number
    USING scope;
    after_grant := extract(epoch FROM clock_timestamp() - granted);
END
$$;
