INSERT INTO incidents.entities (organization_id, external_id)
SELECT organization_id, $2 FROM incidents.policies WHERE id = $1
RETURNING id
