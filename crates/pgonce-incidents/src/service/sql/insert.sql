INSERT INTO incidents.incidents
       (id, organization_id, number, policy_id, entity_id, source_message_id,
        idempotency_key, title, opened_by)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
RETURNING id, organization_id, number, policy_id, entity_id, lifecycle, title,
          opened_by, opened_at, acknowledged_by, acknowledged_at, resolved_by, resolved_at
