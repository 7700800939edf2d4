-- A policy that allows a single OPEN incident per entity (invariant I1).
INSERT INTO incidents.policies (organization_id, name, singleton)
SELECT id, $1, 'always' FROM incidents.organizations WHERE name = 'seed000'
RETURNING id
