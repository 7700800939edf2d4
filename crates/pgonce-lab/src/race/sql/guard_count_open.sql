SELECT count(*) FROM incidents.incidents
 WHERE policy_id = $1 AND entity_id = $2 AND lifecycle = 'OPEN'
