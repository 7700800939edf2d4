-- Figures for a report over organizations $1, one column per field of
-- `Tallies`.
SELECT (SELECT count(*) FROM incidents.incidents WHERE organization_id = ANY($1)) AS incidents,
       (SELECT count(*) FROM incidents.incidents WHERE organization_id = ANY($1) AND lifecycle = 'OPEN') AS open,
       (SELECT count(*) FROM incidents.notifications n
          JOIN incidents.incidents i ON i.id = n.incident_id WHERE i.organization_id = ANY($1)) AS notifications,
       (SELECT coalesce(sum(deliveries), 0)::bigint FROM incidents.observations WHERE organization_id = ANY($1)) AS deliveries_processed,
       (SELECT count(*) FROM incidents.observations WHERE organization_id = ANY($1)) AS messages_processed,
       (SELECT coalesce(sum(n - 1), 0)::bigint FROM (
          SELECT count(*) AS n FROM incidents.incidents
           WHERE organization_id = ANY($1) AND source_message_id IS NOT NULL
           GROUP BY policy_id, entity_id, source_message_id HAVING count(*) > 1) d) AS opened_twice_for_one_message,
       (SELECT count(*) FROM incidents.incidents WHERE organization_id = ANY($1) AND policy_id IS NULL) AS declared
