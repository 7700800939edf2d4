-- The ordinary tables and the function names of schema $1, sorted, each
-- name once (a function's overloads share it).
SELECT
    ARRAY(
        SELECT c.relname::text
        FROM pg_class AS c
        JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')
        ORDER BY 1
    ) AS tables,
    ARRAY(
        SELECT DISTINCT p.proname::text
        FROM pg_proc AS p
        JOIN pg_namespace AS n ON n.oid = p.pronamespace
        WHERE n.nspname = $1
        ORDER BY 1
    ) AS functions
