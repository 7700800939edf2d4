-- What is missing of schema $1 with tables $2 and functions $3: the schema
-- itself when it is gone (its objects went with it), else each missing
-- table, then each missing function ("name()", any overload counts).
SELECT 'schema ' || $1 AS missing
WHERE to_regnamespace(quote_ident($1)) IS NULL
UNION ALL
(
    SELECT $1 || '.' || t.name
    FROM unnest($2::text[]) AS t (name)
    WHERE to_regnamespace(quote_ident($1)) IS NOT NULL
        AND to_regclass(quote_ident($1) || '.' || quote_ident(t.name)) IS NULL
    ORDER BY t.name
)
UNION ALL
(
    SELECT $1 || '.' || f.name || '()'
    FROM unnest($3::text[]) AS f (name)
    WHERE NOT EXISTS (
        SELECT
        FROM pg_proc AS p
        WHERE p.pronamespace = to_regnamespace(quote_ident($1))
            AND p.proname = f.name
    )
        AND to_regnamespace(quote_ident($1)) IS NOT NULL
    ORDER BY f.name
)
