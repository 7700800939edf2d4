-- Creates the entity with no attributes on first sight; an existing one is
-- left as it is (and no row comes back).
INSERT INTO incidents.entities (organization_id, external_id, attributes)
VALUES ($1, $2, '{}')
ON CONFLICT (organization_id, external_id) DO NOTHING
RETURNING id, organization_id, external_id, attributes, singleton_incidents
