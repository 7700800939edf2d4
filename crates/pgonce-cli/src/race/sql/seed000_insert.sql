-- The seed's T08/T10 write.
INSERT INTO incidents.incidents (organization_id, policy_id, entity_id, summary)
SELECT organization_id, id, $2, $3 FROM incidents.policies WHERE id = $1
