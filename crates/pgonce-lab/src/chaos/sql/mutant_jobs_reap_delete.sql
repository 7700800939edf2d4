-- Mutant: a reaper that deletes the round's jobs whose lease ran out
-- instead of returning them to pending.
DELETE FROM pgonce.jobs
WHERE kind = $1 AND status = 'processing' AND lease_expires_at < now()
