-- Every incident of organizations $1, for the audit of what the webhook
-- receiver accepted: each was to be notified once.
SELECT id FROM incidents.incidents WHERE organization_id = ANY($1) ORDER BY id
