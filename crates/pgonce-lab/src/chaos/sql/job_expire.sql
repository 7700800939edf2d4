-- The lease of job $1 runs out now, while its worker is still busy (what a
-- long pause would do, without waiting for it).
UPDATE pgonce.jobs SET lease_expires_at = now() - interval '1 second'
WHERE id = $1 AND status = 'processing'
