-- $2 pending jobs of kind $1, in one statement; returns the first and last id.
WITH inserted AS (
    INSERT INTO pgonce.jobs (kind, payload)
    SELECT $1, jsonb_build_object('n', n)
    FROM generate_series(1, $2) AS n
    RETURNING id
)
SELECT min(id) AS first, max(id) AS last FROM inserted
