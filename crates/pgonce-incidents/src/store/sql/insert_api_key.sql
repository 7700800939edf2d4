INSERT INTO incidents.api_keys (organization_id, prefix, sha256, name)
VALUES ($1, $2, $3, $4)
RETURNING id
