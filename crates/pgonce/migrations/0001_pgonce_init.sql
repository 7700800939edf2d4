-- pgonce keeps its own tables in the `pgonce` schema, so they never collide
-- with the application's. Each pattern adds its tables in its own migration.
CREATE SCHEMA IF NOT EXISTS pgonce;
