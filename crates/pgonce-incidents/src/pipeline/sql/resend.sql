-- A delivery of an observation the pipeline already finished with: the
-- same organization, message id and entity (a producer's late resend, or a
-- redelivery whose delete was lost). Counted on its ledger row, and nothing
-- else is done: one row updated means it was processed before.
UPDATE incidents.observations o
   SET deliveries   = o.deliveries + 1,
       processed_at = now()
  FROM incidents.entities e
 WHERE o.organization_id = $1 AND o.message_id = $2
   AND e.organization_id = $1 AND e.external_id = $3 AND o.entity_id = e.id
