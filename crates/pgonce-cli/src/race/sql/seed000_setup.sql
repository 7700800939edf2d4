-- One organization; each strategy gets a policy and an entity of its own.
INSERT INTO incidents.organizations (name) VALUES ('seed000');
