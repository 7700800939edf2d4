DROP INDEX IF EXISTS incidents.seed000_one_open_incident
