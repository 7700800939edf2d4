-- Creates the entity on first sight, else records its latest attributes.
INSERT INTO incidents.entities (organization_id, external_id, attributes)
VALUES ($1, $2, $3)
ON CONFLICT (organization_id, external_id)
DO UPDATE SET attributes = EXCLUDED.attributes, updated_at = now()
RETURNING id, organization_id, external_id, attributes, singleton_incidents
