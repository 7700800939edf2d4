-- One keyset page, newest number first. NULL filters match everything.
SELECT id, organization_id, number, policy_id, entity_id, lifecycle, title,
       opened_by, opened_at, acknowledged_by, acknowledged_at, resolved_by, resolved_at
  FROM incidents.incidents
 WHERE organization_id = $1
   AND ($2::text IS NULL OR lifecycle = $2)
   AND ($3::bigint IS NULL OR policy_id = $3)
   AND ($4::bigint IS NULL OR entity_id = $4)
   AND ($5::bigint IS NULL OR number < $5)
 ORDER BY number DESC
 LIMIT $6
