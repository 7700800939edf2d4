-- The organization of a live key, looked up by its public prefix; the
-- caller compares the stored hash.
SELECT organization_id, sha256 FROM incidents.api_keys
 WHERE prefix = $1 AND revoked_at IS NULL
