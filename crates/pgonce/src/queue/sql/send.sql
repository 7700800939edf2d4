-- One message. $1 queue, $2 body, $3 attributes, $4 group id, $5 dedup id,
-- $6 delay ms (NULL: the queue's), $7 notify, $8 the lock keys of the
-- message's FIFO group and deduplication id, ascending (none without
-- either; postgres.rs, send_lock_keys), $9 whether the queue deduplicates
-- by content as the handle saw it when it chose the dedup id (NULL: the
-- sender gave the id): no row unless the queue still does, so a handle
-- opened before the queue changed never sends under the wrong id, $10
-- whether the handle's queue is FIFO: no row for a queue of the other
-- kind under its name (its queue deleted by hand, another created).
-- The group's lock is taken before the id is drawn and held until the
-- sending transaction ends (pgonce.queue_lock_keys, migration 0220: waiting
-- as long as it takes, whatever lock_timeout the session inherited): within a group, ids are drawn in commit order,
-- so a receive never takes a message as its group's head while an earlier
-- one is still uncommitted (pick_fifo.sql).
-- The dedup id's lock, likewise, is taken before its claim: a claim then
-- never waits for another sender's uncommitted one, whose sender holds the
-- lock.
-- The window and the delay run from this statement, not from the start of
-- its transaction (a send_in late in a long transaction would otherwise
-- claim an id already expired, and a delay shorter than the transaction's
-- age would be no delay).
-- With a dedup id, the id is claimed in queue_dedup first; a live claim
-- (within the window) makes this a duplicate: nothing is inserted and the
-- original id is returned. No row at all: the queue does not exist, or a
-- concurrent sender's claim committed after this statement's snapshot
-- (the caller retries once to read it).
WITH q AS (
    SELECT name, delay_ms, dedup_window_ms FROM pgonce.queue
    WHERE name = $1
      AND fifo = $10
      AND ($9::boolean IS NULL OR content_based_dedup = $9)
      -- A send with no key to lock (no FIFO group, no deduplication id:
      -- most standard sends) skips the call, which costs a plan of the
      -- function and a setting changed and put back at every call; CASE
      -- evaluates its branches in order.
      AND CASE WHEN cardinality($8::bigint[]) = 0 THEN true
               ELSE pgonce.queue_lock_keys($8::bigint[]) >= 0 END
), claim AS (
    INSERT INTO pgonce.queue_dedup AS d (queue, dedup_id, message_id, expires_at)
    SELECT q.name, $5, nextval('pgonce.queue_message_id_seq'),
           statement_timestamp() + q.dedup_window_ms * interval '1 millisecond'
    FROM q
    WHERE $5::text IS NOT NULL
    ON CONFLICT (queue, dedup_id) DO UPDATE
    SET message_id = EXCLUDED.message_id, expires_at = EXCLUDED.expires_at
    WHERE d.expires_at <= statement_timestamp()
    RETURNING message_id
), ins AS (
    INSERT INTO pgonce.queue_message (id, queue, body, attributes, group_id, dedup_id, visible_at)
    SELECT coalesce((SELECT message_id FROM claim), nextval('pgonce.queue_message_id_seq')),
           q.name, $2, $3, $4, $5,
           statement_timestamp() + coalesce($6, q.delay_ms) * interval '1 millisecond'
    FROM q
    WHERE $5::text IS NULL OR EXISTS (SELECT 1 FROM claim)
    RETURNING id
), woken AS (
    SELECT pg_notify('pgonce_queue', $1) FROM ins WHERE $7
)
SELECT ins.id, false AS duplicate FROM ins WHERE (SELECT count(*) FROM woken) >= 0
UNION ALL
SELECT d.message_id, true
FROM pgonce.queue_dedup d
WHERE d.queue = $1 AND d.dedup_id = $5 AND NOT EXISTS (SELECT 1 FROM claim)
  AND EXISTS (SELECT 1 FROM q)
