-- The race's T08/T10 write.
INSERT INTO incidents.incidents (organization_id, number, policy_id, entity_id, title, opened_by)
SELECT organization_id, nextval('public.race_guard_numbers'), id, $2, 'race-guard', $3
  FROM incidents.policies WHERE id = $1
