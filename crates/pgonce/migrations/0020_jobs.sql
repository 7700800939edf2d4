-- Jobs (pattern P3): the row is the job's state machine and its retry ledger.
--
--   pending     runnable once run_at <= now(); claim -> processing,
--               transition -> completed | dead.
--   processing  leased (lease_token, lease_expires_at); complete -> completed,
--               fail -> failed | dead, heartbeat extends; an expired lease is
--               reaped -> pending (or dead past max_attempts).
--   failed      waiting for its retry at run_at; the re-driver -> pending.
--   completed   terminal.
--   dead        terminal: past max_attempts, or cancelled; last_error says why.
--
-- attempts counts failed attempts (errors and expired leases), always
-- incremented in SQL.
CREATE TABLE pgonce.jobs (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind             text        NOT NULL,
    payload          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    status           text        NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'processing', 'failed', 'completed', 'dead')),
    attempts         integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts     integer     NOT NULL DEFAULT 5 CHECK (max_attempts > 0),
    lease_token      uuid,
    lease_expires_at timestamptz,
    run_at           timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    claimed_at       timestamptz,
    finished_at      timestamptz,
    result           jsonb,
    last_error       text,
    -- A lease exists exactly while the job is processing.
    CONSTRAINT jobs_lease_iff_processing CHECK (
        (status = 'processing') = (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL)
        AND (lease_token IS NULL) = (lease_expires_at IS NULL)
    ),
    -- A completed job has no error pending retry; finished_at marks terminal states.
    CONSTRAINT jobs_finished_iff_terminal CHECK (
        (status IN ('completed', 'dead')) = (finished_at IS NOT NULL)
    )
);

CREATE INDEX jobs_runnable ON pgonce.jobs (kind, run_at, id) WHERE status = 'pending';
CREATE INDEX jobs_leased ON pgonce.jobs (lease_expires_at) WHERE status = 'processing';
CREATE INDEX jobs_retrying ON pgonce.jobs (run_at) WHERE status = 'failed';
