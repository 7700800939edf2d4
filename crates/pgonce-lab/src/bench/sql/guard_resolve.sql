UPDATE bench_guard_incidents SET open = false WHERE id = $1
