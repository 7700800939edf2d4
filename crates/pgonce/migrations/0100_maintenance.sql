-- Maintenance (pgonce::maintenance): one index per cleaner, so that each
-- batch finds the oldest rows past retention without scanning live ones.
-- Each is partial on the cleaner's own predicate where it has one, so it
-- holds only rows the cleaner may take.

-- Completed jobs, by when they finished.
CREATE INDEX jobs_completed_age ON pgonce.jobs (finished_at) WHERE status = 'completed';
-- Dead jobs, by when they died (jobs_dead leads with kind, for the operator).
CREATE INDEX jobs_dead_age ON pgonce.jobs (finished_at) WHERE status = 'dead';
-- Deduplication claims, by when their window ends.
CREATE INDEX queue_dedup_expiry ON pgonce.queue_dedup (expires_at);
-- Messages moved to a dead-letter queue and not redriven, by when they were sent.
CREATE INDEX queue_message_dead_lettered_age ON pgonce.queue_message (sent_at)
    WHERE dead_lettered_from IS NOT NULL;
