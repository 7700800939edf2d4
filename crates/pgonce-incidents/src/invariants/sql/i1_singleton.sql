-- I1: (policy, entity) pairs whose policy is a singleton for that entity now
-- and that have more than one OPEN incident. Zero rows: I1 holds.
SELECT i.policy_id, i.entity_id, count(*) AS open
  FROM incidents.incidents i
  JOIN incidents.policies p ON p.id = i.policy_id
  JOIN incidents.entities e ON e.id = i.entity_id
 WHERE i.lifecycle = 'OPEN'
   AND (p.singleton = 'always' OR (p.singleton = 'per_entity' AND e.singleton_incidents))
 GROUP BY i.policy_id, i.entity_id
HAVING count(*) > 1
 ORDER BY 1, 2
