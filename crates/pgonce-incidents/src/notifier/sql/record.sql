-- Recorded in the transaction that completes the job under its lease, so
-- at most one per incident (the primary key backs it up).
INSERT INTO incidents.notifications (incident_id, idempotency_key, attempts, status_code)
VALUES ($1, $2, $3, $4)
