-- table-lock (the sequenced gem): EXCLUSIVE conflicts with ROW EXCLUSIVE, so
-- every INSERT, UPDATE and DELETE on the table, of every scope, waits until
-- this transaction ends. Reads still run.
LOCK TABLE {table} IN EXCLUSIVE MODE
