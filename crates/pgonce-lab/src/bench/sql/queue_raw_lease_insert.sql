INSERT INTO bench_queue_raw_lease (body) VALUES ($1)
