-- One row per side effect run (the remote call the job stands for).
CREATE TABLE IF NOT EXISTS race_jobs_side_effects (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id     bigint NOT NULL,
    by_session text   NOT NULL
);
