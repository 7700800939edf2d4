-- First use inserts and holds the key. A later use takes the hold over only
-- when the previous holder's hold expired (it died) and the request is the
-- same one. Otherwise no row comes back; run again in a transaction,
-- key_read.sql then says why: ON CONFLICT DO UPDATE locks the conflicting
-- row even when its WHERE is false, so the key cannot change in between.
-- acquired_in, the transaction taking the hold, lets finish and release
-- tell a snapshot older than the hold from a lost hold (migration 0200).
INSERT INTO pgonce.idempotency_keys AS k (scope, key, fingerprint, hold_token, held_until)
VALUES ($1, $2, $3, gen_random_uuid(), now() + make_interval(secs => $4))
ON CONFLICT (scope, key) DO UPDATE
SET hold_token = gen_random_uuid(),
    held_until = now() + make_interval(secs => $4)
WHERE k.status = 'in_progress'
  AND k.held_until < now()
  AND k.fingerprint = EXCLUDED.fingerprint
RETURNING k.hold_token, k.held_until, (k.xmax = 0) AS inserted,
    pg_current_xact_id()::text::bigint AS acquired_in
