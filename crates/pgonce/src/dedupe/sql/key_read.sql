-- Why key_acquire.sql took nothing, read in its transaction: the row its
-- upsert locked, as the last writer committed it.
SELECT fingerprint, status, response
FROM pgonce.idempotency_keys
WHERE scope = $1 AND key = $2
