-- counter-row: the scope's counter row in pgonce.sequence_counters, created
-- on first use from the table's max + 1 (so a table with numbers already in
-- it is adopted), else moved to one past the greater of itself and the
-- table's max. The row lock taken by the upsert is held until the
-- transaction ends; a rollback undoes the move.
-- Why the max again on every take: the other strategies number the same
-- scope under other locks and never move the counter, so a scope numbered
-- by them (a strategy changed between two deploys, or both running during
-- one) would leave the counter behind, and every later take would hand out
-- a number already taken, be refused by the unique index and roll back the
-- counter with it: the scope could never be numbered again by this
-- strategy. The max is the unique index's last entry for the scope. The
-- statement's snapshot may predate the counter row's lock, so the max may
-- miss what a counter-row taker committed meanwhile; that taker moved the
-- counter, which the upsert reads as it is now.
-- The wait for the row lock lasts as long as it takes, as the other
-- strategies' waits do (migration 0210), whatever lock_timeout the session
-- inherited (an operator's ALTER ROLE ... SET lock_timeout): the CTE, read
-- once, lifts it (0: no bound) when the row to insert is computed, before
-- the conflict is met and waited for, and RETURNING, computed once the row
-- is written, puts the value in force before back. If the wait fails, the
-- transaction is aborted and its ROLLBACK restores the setting anyway.
-- The insert's max + '1' adds a one of the column's type (an untyped
-- literal takes its operand's), so past the column's largest value it is
-- out of range (22003, the scope exhausted), as in pgonce.sequence_take
-- (migration 0270).
-- $1 the counter key (table and columns, NumberedTable::counter_key), $2 scope as text, $3 scope as the column's type.
WITH unbounded AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS was,
           set_config('lock_timeout', '0', true) AS lifted
)
INSERT INTO pgonce.sequence_counters AS c (sequence, scope, last_number)
SELECT $1, $2,
       (COALESCE(max({number}) + '1', 1)
        + (SELECT 0 FROM unbounded WHERE lifted IS NOT NULL))::bigint
FROM {table} WHERE {scope} = $3
ON CONFLICT (sequence, scope) DO UPDATE
SET last_number = (
    -- The next number in the number column's type, as the insert above and
    -- the other strategies compute it: past an int or smallint column's
    -- largest value it is out of range (22003, the scope exhausted) rather
    -- than a number the column cannot hold. The counter can be ahead of
    -- the table (a take committed without its row, a row deleted), so the
    -- table's max alone does not meet that bound. pg_typeof(max(n)) is the column's type even
    -- when the scope has no row.
    SELECT CASE column_type WHEN 'integer'::regtype THEN next::integer
                            WHEN 'smallint'::regtype THEN next::smallint
                            ELSE next END
    FROM (SELECT greatest(c.last_number, COALESCE(max({number}), 0)::bigint) + 1 AS next,
                 pg_typeof(max({number})) AS column_type
          FROM {table} WHERE {scope} = $3) AS taken)
RETURNING c.last_number,
          set_config('lock_timeout', (SELECT was FROM unbounded), true) AS restored
