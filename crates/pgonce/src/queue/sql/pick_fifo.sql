    -- FIFO queue: only the head of each group, and only when visible. A head
    -- in flight (or delayed) is not visible, and everything behind it is not
    -- a head: at most one message per group in flight, in order. Other
    -- groups' heads are independent of it.
    -- "Behind" is by position in the group: the id, or the position a
    -- redrive or a dead-letter move gave the message (migrations 0130,
    -- 0132). Within a group positions are drawn in commit order, under the
    -- group's lock (send.sql, redrive.sql, receive_tail.sql), so a receive
    -- whose snapshot misses a message that committed later misses one
    -- behind every message it does see.
    -- OFFSET 0 keeps "is there an earlier message in the group?" a probe of
    -- queue_message_group per candidate: without it the planner may turn it
    -- into an anti-join, and on statistics taken while the queue was small
    -- it chose a nested loop over every pair of the queue's messages (2.3
    -- million comparisons, 453 ms, for 2,000 messages; 5.7 ms with the
    -- probe). tests/queue.rs,
    -- `a_fifo_receive_probes_each_head_on_stale_statistics`.
    -- The ORDER BY is that index's order within a group: with few groups,
    -- each holding a large share of the table, the planner expected a
    -- sequential scan to find an earlier message at once and scanned the
    -- table for each candidate (3 groups of 10,000 messages: 30 million
    -- rows, 2.5 s per receive). A sequential scan would now have to sort
    -- its rows first (OFFSET 0 keeps the sort), so the probe stays a
    -- lookup of the group. tests/queue.rs,
    -- `a_fifo_receive_on_few_groups_probes_the_group_not_the_table`.
    SELECT m.id, m.group_id, m.visible_at, m.sent_at, m.receive_count, m.receive_base
    FROM pgonce.queue_message m
    -- `group_id >= ''` (true of every FIFO message: each has a group) lets
    -- the walk in id order read this queue's messages only, from
    -- queue_message_fifo_walk, not the primary key through every queue's.
    -- It is that index's predicate, in a form the probe below cannot
    -- prove, so the probe never walks the queue through it (migration
    -- 0140).
    WHERE m.queue = $1 AND m.group_id >= '' AND m.visible_at <= now()
      AND NOT EXISTS (
          SELECT 1 FROM pgonce.queue_message e
          WHERE e.queue = m.queue AND e.group_id = m.group_id
            AND coalesce(e.group_position, e.id) < coalesce(m.group_position, m.id)
          ORDER BY coalesce(e.group_position, e.id)
          OFFSET 0)
      -- Heads an earlier statement of this receive held back (a move
      -- that waits for a sender, receive_tail.sql): passed over, so they
      -- take no place of the batch.
      AND m.id <> ALL($4::bigint[])
    ORDER BY m.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
