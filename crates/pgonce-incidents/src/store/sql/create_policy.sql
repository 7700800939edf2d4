INSERT INTO incidents.policies (organization_id, name, singleton, rule)
VALUES ($1, $2, $3, $4)
ON CONFLICT (organization_id, name) DO NOTHING
RETURNING id, organization_id, name, singleton, rule
