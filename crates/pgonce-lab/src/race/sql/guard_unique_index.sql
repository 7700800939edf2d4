-- The first fix one reaches for: right only while the rule is static ("this
-- policy is a singleton for every entity"), which it is in this race and is
-- not in the service (per-entity singleton-ness at run time). $policy is
-- replaced by the race's own policy id.
CREATE UNIQUE INDEX race_guard_one_open_incident
    ON incidents.incidents (policy_id, entity_id)
 WHERE lifecycle = 'OPEN' AND policy_id = $policy
