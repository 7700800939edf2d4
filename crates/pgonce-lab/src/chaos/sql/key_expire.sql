-- The hold on idempotency key ($1, $2) runs out now, while its request is
-- still being processed.
UPDATE pgonce.idempotency_keys SET held_until = now() - interval '1 second'
WHERE scope = $1 AND key = $2 AND status = 'in_progress'
