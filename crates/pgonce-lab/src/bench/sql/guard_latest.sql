-- What a decision sees: the entity's latest incident and whether it is open.
SELECT id, open FROM bench_guard_incidents WHERE entity = $1 ORDER BY id DESC LIMIT 1
