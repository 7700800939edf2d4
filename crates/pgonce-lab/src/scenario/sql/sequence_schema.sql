-- The sequence scenario's numbered table (standing for `incidents`): one row
-- per declaration, tagged with the run's scope and the operation that
-- numbered it (a chaos history's op id; a worker's number elsewhere). The
-- unique index on (scope, number) backs every strategy and is what the
-- sequence numbers by (and checks for); numbers start at 1, so a scope's
-- numbers are gapless when its max is its count. The work table takes the
-- declaration's other writes. In `public` explicitly: the role may be named
-- like the `pgonce` schema.
CREATE TABLE IF NOT EXISTS public.sequence_incident (
    scope  text   NOT NULL,
    number bigint NOT NULL CHECK (number > 0),
    op     bigint NOT NULL,
    UNIQUE (scope, number)
);
CREATE TABLE IF NOT EXISTS public.sequence_work (
    scope text NOT NULL,
    what  text NOT NULL
);
