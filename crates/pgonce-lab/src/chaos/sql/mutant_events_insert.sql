-- Mutant: a writer that inserts into the log directly, taking none of the
-- strategy's publishing keys, so a condition checked while it is in
-- flight cannot see it (and, at READ COMMITTED, SSI never learns of it).
INSERT INTO pgonce.events (type, tags, data) VALUES ($1, $2, $3)
RETURNING position
