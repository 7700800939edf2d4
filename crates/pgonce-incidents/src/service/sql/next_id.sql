-- The new incident's id, drawn before its number so that the notification
-- job and the timeline event can name it while the organization's number
-- lock is not yet taken.
SELECT nextval(pg_get_serial_sequence('incidents.incidents', 'id'))
