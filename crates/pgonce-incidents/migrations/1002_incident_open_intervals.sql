-- I1 is "never two OPEN at once", so it is checked over each incident's OPEN
-- interval, not only in the final state (an incident acknowledged or
-- resolved since would hide a duplicate): see invariants/sql/i1_singleton.sql.
--
-- one_at_a_time: whether the policy allowed a single OPEN incident for this
-- entity when this incident opened (the rule the guarded write compared; a
-- per_entity policy's answer changes at run time). False for declarations.
ALTER TABLE incidents.incidents
    ADD COLUMN one_at_a_time boolean NOT NULL DEFAULT false;

-- The interval's ends are the moments the statements ran (clock_timestamp),
-- not the transactions' starts (now()): a guarded creation that waited for
-- the entity's lock would otherwise date itself before an acknowledgement it
-- waited for. A creation's insert runs after its re-read, which runs after
-- the previous change committed, so under the guard a new incident always
-- opens after the one it replaced stopped being OPEN.
ALTER TABLE incidents.incidents
    ALTER COLUMN opened_at SET DEFAULT clock_timestamp();
