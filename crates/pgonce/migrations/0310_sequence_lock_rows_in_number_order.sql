-- Select-for-update locks a scope's rows in number order.
--
-- pgonce.sequence_take (migration 0270) locked them in whatever order its
-- plan read them: a sequential scan in heap order, an index scan in index
-- order. A number handed out again after a rollback lies in the heap after
-- higher ones, so two takers planned differently (the plan changes with
-- the statistics, as when autovacuum first analyzes the table) could each
-- wait at a different row of the same holder, lock it once the holder
-- ended, then wait for the row the other had locked: a deadlock, one of
-- them aborted (40P01). With ORDER BY the lock step sits above a sort, so
-- every taker locks the scope's lowest number first; the second queues
-- behind the first there, as under the other strategies.
--
-- The body is 0270's but for that ORDER BY. CREATE OR REPLACE assigns every
-- property the command does not state, so the SET clause of migration
-- 0210 (lock waits unbounded whatever the session inherited) is restated.
CREATE OR REPLACE FUNCTION pgonce.sequence_take(
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
SET lock_timeout = 0
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
        -- locks the scope's existing rows only, in number order, so that
        -- every taker queues at the same first row.
        EXECUTE format(
            'SELECT count(*) FROM (SELECT 1 FROM %s WHERE %I = $1 ORDER BY %I FOR UPDATE) AS locked',
            tbl, scope_column, number_column)
        USING scope;
    ELSE
        RAISE EXCEPTION 'pgonce.sequence_take: unknown strategy %', strategy
            USING ERRCODE = 'invalid_parameter_value';
    END CASE;
    granted := clock_timestamp();
    -- A statement of its own: its snapshot is taken now, after the lock.
    -- The sum is in the column's type: out of range (22003) past its end.
    EXECUTE format(
        'SELECT COALESCE(max(%I) + ''1'', 1)::bigint FROM %s WHERE %I = $1',
        number_column, tbl, scope_column)
    INTO number
    USING scope;
    after_grant := extract(epoch FROM clock_timestamp() - granted);
END
$$;
