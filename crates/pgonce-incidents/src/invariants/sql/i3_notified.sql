-- I3: incidents not notified exactly once: no notifications row, or a
-- notification job count other than one, or that job not completed.
SELECT i.id,
       (SELECT count(*) FROM incidents.notifications n WHERE n.incident_id = i.id) AS notified,
       (SELECT count(*) FROM pgonce.jobs j
         WHERE j.kind = 'incident-notification' AND (j.payload->>'incident_id')::bigint = i.id) AS jobs,
       (SELECT count(*) FROM pgonce.jobs j
         WHERE j.kind = 'incident-notification' AND (j.payload->>'incident_id')::bigint = i.id
           AND j.status = 'completed') AS completed
  FROM incidents.incidents i
 WHERE i.organization_id = ANY($1)
