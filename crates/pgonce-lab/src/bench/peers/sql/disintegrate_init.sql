-- disintegrate-postgres 4.0.1's migrator (Migrator::init_event_store), as one
-- script, for PostgreSQL 15: its event_store_begin_epoch() writes 0xFFFFFFFF,
-- a hex literal only PostgreSQL 16 accepts; here 4294967295, the same value.
-- Plus the column and partial index its migrator adds for the domain id
-- bench_id. Nothing else differs.

-- seq_event_event_id.sql
CREATE SEQUENCE IF NOT EXISTS seq_event_event_id;

-- table_event.sql
CREATE TABLE IF NOT EXISTS event (
    event_id BIGINT PRIMARY KEY DEFAULT nextval('seq_event_event_id'),
    event_type VARCHAR(255),
    payload BYTEA,
    inserted_at TIMESTAMP DEFAULT now()
);

-- idx_event_type.sql
CREATE INDEX IF NOT EXISTS idx_event_type_btree ON event(event_type);

-- fn_event_store_current_epoch.sql
CREATE OR REPLACE FUNCTION event_store_current_epoch()
RETURNS BIGINT AS $$
DECLARE
    persisted_event_id BIGINT;
    pending_event_id BIGINT;
    db_id INT;
BEGIN
    SELECT COALESCE(MAX(event_id), 0) INTO persisted_event_id FROM event;
    SELECT oid INTO db_id FROM pg_database WHERE datname = current_database();

    SELECT MIN((l3.objid::bigint << 32) + l2.objid::bigint)
    INTO pending_event_id
    FROM pg_locks l1
    INNER JOIN pg_locks l2 ON l1.pid = l2.pid
    INNER JOIN pg_locks l3 ON l1.pid = l3.pid
    WHERE
        l1.classid = db_id
        AND l2.classid = 1
        AND l3.classid = 2
        AND l1.locktype = 'advisory';

    RETURN LEAST(COALESCE(pending_event_id, persisted_event_id), persisted_event_id);
END;
$$ LANGUAGE plpgsql;

-- fn_event_store_begin_epoch.sql
CREATE OR REPLACE FUNCTION event_store_begin_epoch()
RETURNS void AS $$
DECLARE
    id BIGINT;
    db_id INT;
BEGIN
    SELECT last_value INTO id FROM seq_event_event_id;
    SELECT oid INTO db_id FROM pg_database WHERE datname = current_database();

    PERFORM pg_try_advisory_xact_lock_shared(db_id, 0);
    PERFORM pg_try_advisory_xact_lock_shared(1, (id & 4294967295)::bit(32)::integer);
    PERFORM pg_try_advisory_xact_lock_shared(2, (id >> 32)::bit(32)::integer);
END;
$$ LANGUAGE plpgsql;

ALTER TABLE event ADD COLUMN IF NOT EXISTS bench_id TEXT;
CREATE INDEX IF NOT EXISTS idx_event_bench_id ON event (bench_id) WHERE bench_id IS NOT NULL;
