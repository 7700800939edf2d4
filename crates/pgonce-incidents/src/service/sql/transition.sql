-- A conditional transition (the WHERE-status pattern of pgonce's jobs):
-- changes the lifecycle only from one of the states in $3; 0 rows means the
-- incident is elsewhere (or absent).
-- The timestamps are when this statement ran (clock_timestamp), which is
-- what the I1 check compares with other incidents' opened_at.
UPDATE incidents.incidents
   SET lifecycle       = $4,
       acknowledged_by = CASE WHEN $4 = 'ACKNOWLEDGED' THEN $5 ELSE acknowledged_by END,
       acknowledged_at = CASE WHEN $4 = 'ACKNOWLEDGED' THEN clock_timestamp() ELSE acknowledged_at END,
       resolved_by     = CASE WHEN $4 = 'RESOLVED' THEN $5 ELSE resolved_by END,
       resolved_at     = CASE WHEN $4 = 'RESOLVED' THEN clock_timestamp() ELSE resolved_at END
 WHERE organization_id = $1 AND id = $2 AND lifecycle = ANY($3)
RETURNING id, organization_id, number, policy_id, entity_id, lifecycle, title,
          opened_by, opened_at, acknowledged_by, acknowledged_at, resolved_by, resolved_at
