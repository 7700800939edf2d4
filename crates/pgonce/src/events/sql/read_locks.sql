-- locks.sql without the transaction id: the decision read's keys, taken in
-- ascending order ($1 sorted and unique; $2 true = exclusive).
SELECT count(*) AS locks
FROM (
    SELECT CASE WHEN exclusive
                THEN (SELECT 1 FROM pg_advisory_xact_lock(key))
                ELSE (SELECT 1 FROM pg_advisory_xact_lock_shared(key))
           END
    FROM unnest($1::bigint[], $2::bool[]) AS t(key, exclusive)
) AS taken
