-- Revokes one live key of the organization, named by its public prefix.
UPDATE incidents.api_keys SET revoked_at = now()
 WHERE organization_id = $1 AND prefix = $2 AND revoked_at IS NULL
