-- An organization per strategy, with a policy that allows a single OPEN
-- incident per entity (invariant I1). Returns (organization, policy).
WITH org AS (INSERT INTO incidents.organizations (name) VALUES ('race-guard/' || $1) RETURNING id)
INSERT INTO incidents.policies (organization_id, name, singleton, rule)
SELECT id, $1, 'always', '{"attribute": "errors", "op": "gt", "value": 0}' FROM org
RETURNING organization_id, id
