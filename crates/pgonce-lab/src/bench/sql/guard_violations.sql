-- Forks (creations on the same state) plus entities left with more than
-- one open incident.
SELECT (SELECT count(*) - count(DISTINCT (entity, prev)) FROM bench_guard_incidents)
     + (SELECT count(*) FROM (SELECT entity FROM bench_guard_incidents WHERE open
                               GROUP BY entity HAVING count(*) > 1) AS dup)
