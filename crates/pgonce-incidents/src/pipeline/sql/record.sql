-- The pipeline's ledger: one row per message it finished with (I6), the
-- deliveries it took, and what they did.
INSERT INTO incidents.observations (message_id, organization_id, entity_id, incidents, conflicts)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (message_id) DO UPDATE
   SET deliveries   = incidents.observations.deliveries + 1,
       incidents    = incidents.observations.incidents + EXCLUDED.incidents,
       conflicts    = incidents.observations.conflicts + EXCLUDED.conflicts,
       processed_at = now()
