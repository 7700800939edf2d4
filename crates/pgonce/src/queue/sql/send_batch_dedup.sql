-- Many messages, some or all with dedup ids, in one statement. $1 queue,
-- $2 bodies, $3 attributes, $4 group ids, $5 dedup ids (NULL: none), $6
-- delays ms (NULL: the queue's), $7 notify, $8 the lock keys of the
-- batch's FIFO groups and dedup ids, ascending (postgres.rs,
-- send_lock_keys), $9 per message whether the queue deduplicates by
-- content as the handle saw it when it chose the dedup id (NULL: the
-- sender gave the id, or none), $10 whether the handle's queue is FIFO
-- (send.sql: no row for a queue of the other kind). One row per message, in input order: its
-- id and whether it was a duplicate (send.sql).
--
-- One statement, so the batch is all or none without a savepoint: a
-- caller that gives the send up mid-way leaves nothing half sent and
-- nothing for the client to undo in its transaction. No row at all, and
-- nothing sent: the queue does not exist, or its content-based
-- deduplication changed since the handle read it (the caller reads it
-- again and sends under the queue's).
--
-- All keys are taken first, ascending, and held until the transaction
-- ends (send.sql says why), so two batches sharing groups or ids cannot
-- deadlock; through pgonce.queue_lock_keys (migration 0220), which waits
-- as long as it takes, whatever lock_timeout the session inherited (a
-- batch with dedup ids always has keys, so the call is never wasted). Ids are drawn in input order (after the sort: nextval is
-- volatile), so a group's messages keep the batch's order; a duplicate's
-- drawn id goes unused. The first message of each dedup id claims it
-- (later ones in the batch are its duplicates). A live claim this
-- statement's snapshot sees is left as it is and read from that snapshot
-- (`seen`): writing it again, as a duplicate, would make a concurrent
-- REPEATABLE READ sender of the id, whose snapshot predates the write, fail
-- to serialize where a duplicate `send` lets it through. A claim the
-- snapshot does not see as it is (committed by a concurrent sender after
-- the snapshot: this statement waited for that sender's lock) is written
-- again, live or not, so that RETURNING gives its id, as ON CONFLICT sees
-- the latest committed row: there is no message the statement cannot
-- resolve.
WITH q AS (
    SELECT name, delay_ms, dedup_window_ms FROM pgonce.queue
    WHERE name = $1
      AND fifo = $10
      -- The content-based check first, then the locks: a batch refused
      -- here (its handle saw an old setting) must hold no key when it
      -- retries with others, or it could take keys out of order. The
      -- planner orders a WHERE's conditions by its cost estimates; CASE
      -- evaluates in the order written.
      AND CASE WHEN EXISTS (
                   SELECT 1 FROM unnest($9::boolean[]) AS c(by_content)
                   WHERE c.by_content IS DISTINCT FROM content_based_dedup
                     AND c.by_content IS NOT NULL
               ) THEN false
               ELSE pgonce.queue_lock_keys($8::bigint[]) >= 0 END
), m AS MATERIALIZED (
    SELECT b.ord, b.body, b.attributes, b.group_id, b.dedup_id, b.delay_ms,
           nextval('pgonce.queue_message_id_seq') AS id
    FROM q, unnest($2::text[], $3::jsonb[], $4::text[], $5::text[], $6::bigint[])
            WITH ORDINALITY AS b(body, attributes, group_id, dedup_id, delay_ms, ord)
    ORDER BY b.ord
), first_of_id AS (
    SELECT DISTINCT ON (dedup_id) dedup_id, id FROM m
    WHERE dedup_id IS NOT NULL
    ORDER BY dedup_id, ord
), claim AS (
    INSERT INTO pgonce.queue_dedup AS d (queue, dedup_id, message_id, expires_at)
    SELECT q.name, f.dedup_id, f.id,
           statement_timestamp() + q.dedup_window_ms * interval '1 millisecond'
    FROM q, first_of_id f
    ON CONFLICT (queue, dedup_id) DO UPDATE
    SET message_id = CASE WHEN d.expires_at <= statement_timestamp()
                          THEN EXCLUDED.message_id ELSE d.message_id END,
        expires_at = CASE WHEN d.expires_at <= statement_timestamp()
                          THEN EXCLUDED.expires_at ELSE d.expires_at END
    WHERE d.expires_at <= statement_timestamp()
       OR NOT EXISTS (
           SELECT 1 FROM pgonce.queue_dedup s
           WHERE s.queue = d.queue AND s.dedup_id = d.dedup_id
             AND s.message_id = d.message_id AND s.expires_at = d.expires_at
       )
    RETURNING d.dedup_id, d.message_id
), seen AS (
    -- The live claims left as they were (their rows as the snapshot has
    -- them: a claim expired there was renewed by `claim`, which wins).
    SELECT s.dedup_id, s.message_id FROM pgonce.queue_dedup s
    WHERE s.queue = $1 AND s.dedup_id = ANY ($5::text[])
), sent AS (
    SELECT m.ord, m.body, m.attributes, m.group_id, m.dedup_id, m.delay_ms,
           coalesce(c.message_id, s.message_id, m.id) AS id,
           coalesce(coalesce(c.message_id, s.message_id) <> m.id, false) AS duplicate
    FROM m LEFT JOIN claim c ON c.dedup_id = m.dedup_id
           LEFT JOIN seen s ON s.dedup_id = m.dedup_id
), ins AS (
    INSERT INTO pgonce.queue_message (id, queue, body, attributes, group_id, dedup_id, visible_at)
    SELECT s.id, q.name, s.body, s.attributes, s.group_id, s.dedup_id,
           statement_timestamp() + coalesce(s.delay_ms, q.delay_ms) * interval '1 millisecond'
    FROM q, sent s
    WHERE NOT s.duplicate
    ORDER BY s.ord
    RETURNING id
), woken AS (
    SELECT pg_notify('pgonce_queue', $1) WHERE $7 AND EXISTS (SELECT 1 FROM ins)
)
SELECT s.id, s.duplicate FROM sent s
WHERE (SELECT count(*) FROM woken) >= 0
ORDER BY s.ord
