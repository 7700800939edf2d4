UPDATE pgonce.idempotency_keys
SET status = 'done',
    response = $4,
    hold_token = NULL,
    held_until = NULL,
    finished_at = now()
WHERE scope = $1 AND key = $2
  AND status = 'in_progress'
  AND hold_token = $3
