-- One batch of the ledger's cleaner: up to $2 rows whose last delivery was
-- more than $1 seconds ago. FOR UPDATE rechecks the predicate on the newest
-- version of each row, so a delivery that updated a row meanwhile
-- (`resend.sql` and `record.sql` set `processed_at`) keeps it; SKIP LOCKED
-- leaves a row a delivery is updating to the next pass.
WITH old AS (
    SELECT organization_id, message_id, entity_id
      FROM incidents.observations
     WHERE processed_at < now() - make_interval(secs => $1)
     ORDER BY processed_at
     LIMIT $2
       FOR UPDATE SKIP LOCKED
)
DELETE FROM incidents.observations AS o
 USING old
 WHERE o.organization_id = old.organization_id
   AND o.message_id = old.message_id
   AND o.entity_id = old.entity_id
