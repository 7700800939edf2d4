-- Every notification job (kind $1) of the incidents of organizations $2,
-- with how long until it may run and how much of its lease is left: an
-- audit query, read-only, over the columns pgonce's migration documents.
SELECT j.id AS job_id,
       (j.payload->>'incident_id')::bigint AS incident_id,
       j.status,
       j.attempts,
       j.max_attempts,
       j.last_error,
       extract(epoch FROM j.run_at - now())::float8 AS run_in_secs,
       extract(epoch FROM j.lease_expires_at - now())::float8 AS lease_left_secs
  FROM pgonce.jobs j
  JOIN incidents.incidents i ON i.id = (j.payload->>'incident_id')::bigint
 WHERE j.kind = $1
   AND i.organization_id = ANY($2)
 ORDER BY j.id
