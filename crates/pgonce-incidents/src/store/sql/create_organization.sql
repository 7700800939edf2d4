INSERT INTO incidents.organizations (name) VALUES ($1)
ON CONFLICT (name) DO NOTHING
RETURNING id, name, created_at
