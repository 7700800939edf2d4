-- The pipeline's ledger: one row per observation an organization sent that
-- it finished with (I6), the deliveries it took, and what they did. Keyed by
-- organization, message id and entity: one organization's id never lands on
-- another's row, nor one entity's observation on another's that carries the
-- same producer message id.
INSERT INTO incidents.observations (message_id, organization_id, entity_id, incidents, conflicts)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (organization_id, message_id, entity_id) DO UPDATE
   SET deliveries   = incidents.observations.deliveries + 1,
       incidents    = incidents.observations.incidents + EXCLUDED.incidents,
       conflicts    = incidents.observations.conflicts + EXCLUDED.conflicts,
       processed_at = now()
