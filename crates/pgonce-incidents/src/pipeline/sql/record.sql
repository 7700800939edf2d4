-- The pipeline's ledger: one row per message an organization sent that it
-- finished with (I6), the deliveries it took, and what they did. Keyed by
-- organization and message id: one organization's id never lands on
-- another's row.
INSERT INTO incidents.observations (message_id, organization_id, entity_id, incidents, conflicts)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (organization_id, message_id) DO UPDATE
   SET deliveries   = incidents.observations.deliveries + 1,
       incidents    = incidents.observations.incidents + EXCLUDED.incidents,
       conflicts    = incidents.observations.conflicts + EXCLUDED.conflicts,
       processed_at = now()
