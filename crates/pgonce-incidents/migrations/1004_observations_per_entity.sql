-- A processed observation is one entity's: observations of several entities
-- may carry one producer message id, and each is an observation of its own,
-- applied once. Keyed by organization and message id alone, the ledger
-- counted the second entity's delivery on the first one's row, so a resend
-- of the second entity's was not recognised as processed and recorded its
-- attributes again over a newer observation's. The ledger's key becomes
-- (organization_id, message_id, entity_id); every existing row keeps its
-- own key.
ALTER TABLE incidents.observations DROP CONSTRAINT observations_pkey;
ALTER TABLE incidents.observations ADD PRIMARY KEY (organization_id, message_id, entity_id);
