-- What a decision about (policy $1, entity $2) for message $3 depends on:
-- whether the policy is a singleton for this entity right now, its OPEN
-- incidents, and the incidents this message already created. One statement,
-- so one snapshot.
SELECT (p.singleton = 'always' OR (p.singleton = 'per_entity' AND e.singleton_incidents)) AS singleton,
       ARRAY(SELECT i.id FROM incidents.incidents i
              WHERE i.policy_id = p.id AND i.entity_id = e.id AND i.lifecycle = 'OPEN'
              ORDER BY i.id) AS open_ids,
       ARRAY(SELECT i.id FROM incidents.incidents i
              WHERE i.entity_id = e.id AND i.source_message_id = $3 AND i.policy_id = p.id
              ORDER BY i.id) AS from_message_ids
  FROM incidents.policies p
  JOIN incidents.entities e ON e.organization_id = p.organization_id
 WHERE p.id = $1 AND e.id = $2
