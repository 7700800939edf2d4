-- The event store's and the sequences' lock waits are not cut short by the
-- lock_timeout a session inherited.
--
-- An append or decision waits for its keys (or the events table), and a
-- sequence's take for its scope's lock, as long as it takes: that wait is
-- how they keep their guarantees. Run under an operator's ALTER ROLE ...
-- SET lock_timeout (or a database's), these functions failed after that
-- timeout with PostgreSQL's 55P03, which reached the caller as a bare
-- database error. A SET clause on a function sets the value on entry and
-- restores the caller's on exit, so lock_timeout is 0 (no bound) for the
-- function's own statements only; the caller's statements before and after
-- keep the session's value. statement_timeout still bounds every call.
--
-- Each name is unique in the schema, so no argument list is needed.
ALTER FUNCTION pgonce.events_lock SET lock_timeout = 0;
ALTER FUNCTION pgonce.events_enter SET lock_timeout = 0;
ALTER FUNCTION pgonce.events_append SET lock_timeout = 0;
ALTER FUNCTION pgonce.events_decide SET lock_timeout = 0;
ALTER FUNCTION pgonce.events_append_tag_item SET lock_timeout = 0;
ALTER FUNCTION pgonce.events_decide_tag_item SET lock_timeout = 0;
ALTER FUNCTION pgonce.events_check_tag_item SET lock_timeout = 0;
ALTER FUNCTION pgonce.events_append_one_tag_item SET lock_timeout = 0;
ALTER FUNCTION pgonce.sequence_take SET lock_timeout = 0;
