-- After lock_timeout.sql failed in its lock statement (the transaction is
-- aborted from its savepoint on): back to the savepoint, which undoes the
-- local lock_timeout too, and the savepoint gone, as if never taken.
ROLLBACK TO SAVEPOINT pgonce_lock_timeout;
RELEASE SAVEPOINT pgonce_lock_timeout
