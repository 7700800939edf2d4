INSERT INTO incidents.incidents (organization_id, policy_id, entity_id, summary)
SELECT p.organization_id, p.id, $2, $3
  FROM incidents.policies p
 WHERE p.id = $1
RETURNING id
