-- The ledger's cleaner (`maintenance.cleaner.observations`) deletes rows
-- whose last delivery is past its retention, a bounded batch at a time;
-- without this index each batch would scan the whole ledger, and a pass
-- that finds nothing old would scan it all again at every interval.
--
-- IF NOT EXISTS: on a large ledger, building the index here holds the
-- pipeline's ledger writes until it is built. An operator can build it
-- beforehand without blocking them,
--   CREATE INDEX CONCURRENTLY observations_by_processed_at
--       ON incidents.observations (processed_at);
-- and this migration then finds it.
CREATE INDEX IF NOT EXISTS observations_by_processed_at
    ON incidents.observations (processed_at);
