UPDATE incidents.entities SET singleton_incidents = $3, updated_at = now()
 WHERE organization_id = $1 AND id = $2
