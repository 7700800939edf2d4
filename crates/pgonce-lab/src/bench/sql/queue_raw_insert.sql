INSERT INTO bench_queue_raw (body) VALUES ($1)
