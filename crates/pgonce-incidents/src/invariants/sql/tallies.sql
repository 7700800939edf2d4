-- Figures for a report over organizations $1.
SELECT (SELECT count(*) FROM incidents.incidents WHERE organization_id = ANY($1)),
       (SELECT count(*) FROM incidents.incidents WHERE organization_id = ANY($1) AND lifecycle = 'OPEN'),
       (SELECT count(*) FROM incidents.notifications n
          JOIN incidents.incidents i ON i.id = n.incident_id WHERE i.organization_id = ANY($1)),
       (SELECT coalesce(sum(deliveries), 0)::bigint FROM incidents.observations WHERE organization_id = ANY($1)),
       (SELECT count(*) FROM incidents.observations WHERE organization_id = ANY($1)),
       (SELECT coalesce(sum(n - 1), 0)::bigint FROM (
          SELECT count(*) AS n FROM incidents.incidents
           WHERE organization_id = ANY($1) AND source_message_id IS NOT NULL
           GROUP BY policy_id, source_message_id HAVING count(*) > 1) d),
       (SELECT count(*) FROM incidents.incidents WHERE organization_id = ANY($1) AND policy_id IS NULL)
