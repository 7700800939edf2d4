-- I4: each key of the round, its stored response and the operations whose
-- side effect committed.
SELECT k.key, k.status, k.response,
       ARRAY(SELECT e.op FROM public.chaos_key_effect e
             WHERE e.scope = k.scope AND e.key = k.key ORDER BY e.op) AS effect_ops
FROM pgonce.idempotency_keys k
WHERE k.scope = $1
ORDER BY k.key
