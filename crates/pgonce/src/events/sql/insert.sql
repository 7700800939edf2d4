-- Inserts the events of one unconditional append in the order given ($1: a
-- JSON array of {type, tags, data, metadata}); positions are drawn here, in
-- that order. With $2 a channel name, a NOTIFY carrying the last position is
-- queued; it is delivered when (and only if) the transaction commits. With
-- $3 (the serializable strategy) the insert then reads the conditional
-- appends above its lowest position, so that SERIALIZABLE sees this append
-- as a reader of every conditional append drawn after it (see events.rs,
-- "Why every append reads the conditional appends above it").
SELECT pgonce.events_insert($1, $2, false, $3) AS positions
