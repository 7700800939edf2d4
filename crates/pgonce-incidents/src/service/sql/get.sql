SELECT id, organization_id, number, policy_id, entity_id, lifecycle, title,
       opened_by, opened_at, acknowledged_by, acknowledged_at, resolved_by, resolved_at
  FROM incidents.incidents
 WHERE organization_id = $1 AND id = $2
