-- Before each of pgonce's scenarios of `pgonce bench queue`: the dead rows
-- and index entries the scenarios before it left in the shared message and
-- deduplication tables, cleared (a plain VACUUM: it takes no lock that
-- stops reads or writes, and leaves the tables' plans as they were).
VACUUM pgonce.queue_message, pgonce.queue_dedup;
