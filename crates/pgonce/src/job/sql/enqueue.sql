INSERT INTO pgonce.jobs (kind, payload, max_attempts, run_at)
VALUES ($1, $2, $3, coalesce($4, now()))
RETURNING id
