-- I2 in the table: numbers missing below each scope's max (gaps), numbers
-- stored twice (duplicates; the unique index should make these 0), and the
-- number of rows committed.
SELECT COALESCE(sum(max_number - numbers), 0)::bigint       AS gaps,
       COALESCE(sum(numbers - distinct_numbers), 0)::bigint AS duplicates,
       COALESCE(sum(numbers), 0)::bigint                    AS rows
FROM (
    SELECT max(number) AS max_number, count(*) AS numbers, count(DISTINCT number) AS distinct_numbers
    FROM public.bench_seq_incidents
    GROUP BY org
) AS per_scope
