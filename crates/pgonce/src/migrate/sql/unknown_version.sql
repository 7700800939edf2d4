-- The lowest applied version in the runner's own range ($1 to $2) that it
-- does not know ($3): applied by a newer build of the same migrations.
SELECT version
FROM _sqlx_migrations
WHERE version BETWEEN $1 AND $2
  AND NOT (version = ANY ($3))
ORDER BY version
LIMIT 1
