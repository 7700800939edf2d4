INSERT INTO bench_guard_incidents (entity, prev) VALUES ($1, $2)
