SELECT id, name, created_at
  FROM incidents.organizations
 WHERE id > $1
 ORDER BY id LIMIT $2
