DELETE FROM bench_queue_raw_lease WHERE id = $1
