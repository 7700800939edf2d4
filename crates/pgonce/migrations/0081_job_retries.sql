-- Operator retries of dead jobs: who brought a job back, when, why, and
-- what it had been (its attempts, its last error, since when it was dead).
-- One row per retry that took effect; a job retried twice has two rows.
CREATE TABLE pgonce.job_retries (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id            bigint      NOT NULL REFERENCES pgonce.jobs (id) ON DELETE CASCADE,
    retried_by        text        NOT NULL CHECK (retried_by <> ''),
    reason            text,
    retried_at        timestamptz NOT NULL DEFAULT now(),
    previous_attempts integer     NOT NULL,
    previous_error    text,
    dead_since        timestamptz NOT NULL
);

CREATE INDEX job_retries_job ON pgonce.job_retries (job_id, id);
-- The operator's filter: dead jobs of a kind, by when they died.
CREATE INDEX jobs_dead ON pgonce.jobs (kind, finished_at, id) WHERE status = 'dead';
