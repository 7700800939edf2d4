-- locks.sql without the transaction id: the decision read's keys, taken in
-- ascending order ($1 sorted and unique; $2 true = exclusive), waiting as
-- long as it takes whatever lock_timeout the session inherited.
SELECT pgonce.events_lock($1::bigint[], $2::bool[]) AS locked
