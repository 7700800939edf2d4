-- The race's T01/T05 read: open incidents of (policy, entity).
SELECT id FROM incidents.incidents
 WHERE policy_id = $1 AND entity_id = $2 AND lifecycle = 'OPEN'
 ORDER BY id
