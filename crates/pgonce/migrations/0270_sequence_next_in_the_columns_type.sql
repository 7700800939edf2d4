-- The max + 1 strategies compute the next number in the number column's
-- own type, so a `smallint` column's scope is exhausted at 32767 too.
--
-- pgonce.sequence_take (migration 0060) computed COALESCE(max(n), 0) + 1.
-- For an int or bigint column that sum is in the column's type, and past
-- its largest value it is out of range (22003), which the caller reports
-- as the scope exhausted. For a smallint column it was not: COALESCE of a
-- smallint and the integer 0 is an integer, so at 32767 the take returned
-- 32768, a number the column cannot hold, and the caller's write failed
-- with a raw "smallint out of range" instead. max(n) + '1' adds a one of
-- the column's type (an untyped literal takes its operand's), so the sum
-- is out of range exactly where the column ends, for every integer type.
--
-- The body is 0060's but for that sum. CREATE OR REPLACE assigns every
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
    -- The sum is in the column's type: out of range (22003) past its end.
    EXECUTE format(
        'SELECT COALESCE(max(%I) + ''1'', 1)::bigint FROM %s WHERE %I = $1',
        number_column, tbl, scope_column)
    INTO number
    USING scope;
    after_grant := extract(epoch FROM clock_timestamp() - granted);
END
$$;
