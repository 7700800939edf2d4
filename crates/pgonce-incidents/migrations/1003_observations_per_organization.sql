-- A processed observation is the organization's: two organizations may send
-- the same producer message id, and each delivery must be recorded on its
-- own organization's row, never on another's. The ledger's key becomes
-- (organization_id, message_id).
ALTER TABLE incidents.observations DROP CONSTRAINT observations_pkey;
ALTER TABLE incidents.observations ADD PRIMARY KEY (organization_id, message_id);
