SELECT fingerprint, status, response
FROM pgonce.idempotency_keys
WHERE scope = $1 AND key = $2
