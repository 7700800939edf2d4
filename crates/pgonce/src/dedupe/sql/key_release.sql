DELETE FROM pgonce.idempotency_keys
WHERE scope = $1 AND key = $2
  AND status = 'in_progress'
  AND hold_token = $3
