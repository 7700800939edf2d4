-- Many messages without dedup ids, in one statement. $1 queue, $2 bodies,
-- $3 attributes, $4 group ids, $5 delays ms (NULL: the queue's), $6 notify,
-- $7 the lock keys of the batch's FIFO groups, ascending (see send.sql:
-- taken before any id is drawn, held until the transaction ends; ascending,
-- so two batches sharing groups cannot deadlock), $8 whether the handle's
-- queue is FIFO (send.sql: no row for a queue of the other kind).
-- The delay runs from this statement, not from the start of its
-- transaction (send.sql).
-- Ids are assigned in input order. Only to a queue that does not
-- deduplicate by content (its messages would each need a dedup id, and go
-- in send_batch_dedup.sql): no row otherwise, and nothing sent.
WITH q AS (
    SELECT name, delay_ms FROM pgonce.queue
    WHERE name = $1
      AND fifo = $8
      AND NOT content_based_dedup
      -- A send with no key to lock (no FIFO group, no deduplication id:
      -- most standard sends) skips the call, which costs a plan of the
      -- function and a setting changed and put back at every call; CASE
      -- evaluates its branches in order.
      AND CASE WHEN cardinality($7::bigint[]) = 0 THEN true
               ELSE pgonce.queue_lock_keys($7::bigint[]) >= 0 END
), ins AS (
    INSERT INTO pgonce.queue_message (queue, body, attributes, group_id, visible_at)
    SELECT q.name, b.body, b.attributes, b.group_id,
           statement_timestamp() + coalesce(b.delay_ms, q.delay_ms) * interval '1 millisecond'
    FROM q, unnest($2::text[], $3::jsonb[], $4::text[], $5::bigint[])
            WITH ORDINALITY AS b(body, attributes, group_id, delay_ms, ord)
    ORDER BY b.ord
    RETURNING id
), woken AS (
    SELECT pg_notify('pgonce_queue', $1) WHERE $6 AND EXISTS (SELECT 1 FROM ins)
)
SELECT id FROM ins WHERE (SELECT count(*) FROM woken) >= 0 ORDER BY id
