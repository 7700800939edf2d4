-- The incident row, last in its creation transaction (after the number was
-- taken). opened_at defaults to clock_timestamp(): the moment of this insert.
-- $10: whether the policy allowed one OPEN incident for the entity when the
-- decision was made (what the guarded write compared), for the I1 check.
INSERT INTO incidents.incidents
       (id, organization_id, number, policy_id, entity_id, source_message_id,
        idempotency_key, title, opened_by, one_at_a_time)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
RETURNING id, organization_id, number, policy_id, entity_id, lifecycle, title,
          opened_by, opened_at, acknowledged_by, acknowledged_at, resolved_by, resolved_at
