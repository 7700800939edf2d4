SELECT id, organization_id, name, singleton, rule
  FROM incidents.policies
 WHERE organization_id = $1 AND id > $2
 ORDER BY id LIMIT $3
