, fate AS (
    -- The lean first statement of a standard receive (postgres.rs,
    -- RECEIVE_STANDARD_LEAN): it only delivers. A picked message due for
    -- another fate (past retention, due for the dead-letter queue) is left
    -- as it was and reported 'undecided' (receive_report_lean.sql); the
    -- receive then looks again with the full statement, which judges it
    -- anew and acts on it. Without the DELETE and the move's UPDATE the
    -- statement is cheaper to start (PostgreSQL sets up every CTE that
    -- writes, whether or not it has rows to write), and in the common case
    -- no picked message needs them.
    SELECT id, CASE WHEN fate = 'delivered' THEN 'delivered' ELSE 'undecided' END AS fate
    FROM judged
