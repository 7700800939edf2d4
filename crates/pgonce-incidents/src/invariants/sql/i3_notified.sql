-- I3, the counts per incident: its notifications rows, its notification
-- jobs still present (maintenance deletes finished ones after a while),
-- and how many of those are completed. The caller judges them.
SELECT i.id AS incident_id,
       (SELECT count(*) FROM incidents.notifications n WHERE n.incident_id = i.id) AS notifications,
       (SELECT count(*) FROM pgonce.jobs j
         WHERE j.kind = 'incident-notification' AND (j.payload->>'incident_id')::bigint = i.id) AS jobs,
       (SELECT count(*) FROM pgonce.jobs j
         WHERE j.kind = 'incident-notification' AND (j.payload->>'incident_id')::bigint = i.id
           AND j.status = 'completed') AS completed_jobs
  FROM incidents.incidents i
 WHERE i.organization_id = ANY($1)
