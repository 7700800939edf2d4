SELECT id, name, created_at FROM incidents.organizations ORDER BY id
