-- I1, over history: incidents that opened while another incident of the same
-- (policy, entity) was OPEN, though the policy allowed one at a time for that
-- entity when they opened. Zero rows: I1 held for the whole run, not only at
-- the end (where an acknowledgement or a resolution would hide a duplicate).
--
-- An incident is OPEN from opened_at until it is acknowledged or resolved
-- (whichever came first); all three are the moments the statements ran.
-- Under the guard a creation's insert runs after its re-read saw the earlier
-- incident no longer OPEN, so the earlier interval has ended: no row.
SELECT y.policy_id, y.entity_id, y.id AS incident_id,
       min(x.id) AS while_open_id, count(*) AS open_at_the_time
  FROM incidents.incidents y
  JOIN incidents.incidents x
    ON x.policy_id = y.policy_id AND x.entity_id = y.entity_id AND x.id <> y.id
   AND x.opened_at <= y.opened_at
   AND y.opened_at < coalesce(least(x.acknowledged_at, x.resolved_at), 'infinity')
 WHERE y.one_at_a_time
 GROUP BY y.policy_id, y.entity_id, y.id
 ORDER BY 1, 2, 3
