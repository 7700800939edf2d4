SELECT id, organization_id, external_id, attributes, singleton_incidents
  FROM incidents.entities WHERE organization_id = $1 AND id = $2
