      -- Of this statement's kind: a standard queue under the handle's name
      -- (its queue deleted by hand, another created) is none to the
      -- handle ('no_queue', receive_next_visible.sql).
      AND fifo
), picked AS (
    -- FIFO queue: only the head of each group, and only when visible. A head
    -- in flight (or delayed) is not visible, and everything behind it is not
    -- a head: at most one message per group in flight, in order. Other
    -- groups' heads are independent of it.
    -- "Behind" is by position in the group: the id, or the position a
    -- redrive or a dead-letter move gave the message (migrations 0130,
    -- 0132). Within a group positions are drawn in commit order, under the
    -- group's lock (send.sql, redrive.sql, receive_act.sql), so a receive
    -- whose snapshot misses a message that committed later misses one
    -- behind every message it does see.
    --
    -- Heads are found two ways, the second only when the first falls short
    -- ($2 heads asked for):
    --  1. the walk: the queue's oldest 32 * $2 messages in id order,
    --     each kept if visible and no earlier message of its group exists.
    --     With many groups the oldest messages are mostly heads, and the
    --     walk stops as soon as it has $2 of them (the top LIMIT pulls no
    --     more).
    --  2. the skip: the queue's groups one by one (an index skip scan of
    --     queue_message_group, migration 0150's function), each group's
    --     first message kept if visible and newer than the walk's window.
    --     With few groups and a long backlog, the oldest messages are the
    --     groups' followers; walking on would read the whole backlog (one
    --     group of 20,000 messages: 60,000 buffers, 250 ms per receive,
    --     and as much again whenever the head is in flight). The skip
    --     costs one index descent per group, whatever the backlog.
    -- The walk's window and the skip's `id > boundary` split the queue in
    -- two, so no head is found twice. Heads found by the skip come in group
    -- order, not id order: the receive returns them in id order, and no
    -- order between groups is promised. tests/queue.rs,
    -- `a_fifo_receive_on_one_long_group_reads_a_bounded_part_of_it`;
    -- tests/queue_fifo_heads.rs checks random states against the contract.
    WITH walk_window AS NOT MATERIALIZED (
        -- The queue's oldest 32 * $2 messages. Not materialized: the walk
        -- reads it only as far as it needs to find its heads, and the
        -- boundary, which only the skip asks for, reads it again to its
        -- end (a materialized window cost every receive a copy of the rows
        -- it walked). A multiple of $2, not a constant: on statistics that
        -- expect a small queue, a constant window of 320 (more than the
        -- expected rows) was planned as a bitmap scan of the whole queue
        -- and a sort; a generic plan, which cannot know $2, costs the
        -- window as a small part of the queue and walks the index in
        -- order.
        SELECT c.id, c.ctid, c.xmin AS row_xmin, c.queue, c.group_id, c.group_position,
               c.visible_at
        FROM pgonce.queue_message c
        -- `group_id >= ''` (true of every FIFO message: each has a group)
        -- lets the walk in id order read this queue's messages only, from
        -- queue_message_fifo_walk, not the primary key through every
        -- queue's. It is that index's predicate, in a form the probe below
        -- cannot prove, so the probe never walks the queue through it
        -- (migration 0140).
        WHERE c.queue = $1 AND c.group_id >= ''
        ORDER BY c.id
        LIMIT 32 * $2
    ), boundary AS (
        -- The window's newest message; none when the window holds the
        -- whole queue, which the walk then covers.
        SELECT max(id) AS id FROM walk_window HAVING count(*) = 32 * $2
    )
    SELECT m.id, m.group_id, m.visible_at, m.sent_at, m.receive_count, m.receive_base
    FROM (
        SELECT w.id, w.ctid, w.row_xmin FROM walk_window w
        WHERE w.visible_at <= now()
          -- Heads an earlier statement of this receive held back (a move
          -- that waits for a sender, receive_report.sql) or delivered:
          -- passed over, so they take no place of the batch.
          AND w.id <> ALL($4::bigint[])
          -- OFFSET 0 keeps "is there an earlier message in the group?" a
          -- probe of queue_message_group per candidate: without it the
          -- planner may turn it into an anti-join, and on statistics taken
          -- while the queue was small it chose a nested loop over every
          -- pair of the queue's messages (2.3 million comparisons, 453 ms,
          -- for 2,000 messages; 5.7 ms with the probe). tests/queue.rs,
          -- `a_fifo_receive_probes_each_head_on_stale_statistics`.
          -- The ORDER BY is that index's order within a group: with few
          -- groups, each holding a large share of the table, the planner
          -- expected a sequential scan to find an earlier message at once
          -- and scanned the table for each candidate (3 groups of 10,000
          -- messages: 30 million rows, 2.5 s per receive). A sequential
          -- scan would now have to sort its rows first (OFFSET 0 keeps the
          -- sort), so the probe stays a lookup of the group.
          -- tests/queue.rs,
          -- `a_fifo_receive_on_few_groups_probes_the_group_not_the_table`.
          AND NOT EXISTS (
              SELECT 1 FROM pgonce.queue_message e
              WHERE e.queue = w.queue AND e.group_id = w.group_id
                AND coalesce(e.group_position, e.id) < coalesce(w.group_position, w.id)
              ORDER BY coalesce(e.group_position, e.id)
              OFFSET 0)
        UNION ALL
        SELECT h.id, h.row_version, h.row_xmin FROM boundary b
        CROSS JOIN LATERAL pgonce.queue_fifo_heads_after($1, b.id, 32 * $2, $4::bigint[]) h
    ) c
    -- Each head is locked in the row version it was found in (by ctid:
    -- no second index descent), and only in that version (same xmin): a
    -- head another receiver has locked is skipped, and so is one that
    -- changed since the snapshot (received, released, moved to the
    -- dead-letter queue and perhaps redriven behind a message of its group
    -- now in flight, which this snapshot cannot see). Whether it is still
    -- a head could only be judged on a newer snapshot; the next receive
    -- takes it if it is. The skip offers up to 32 heads per message
    -- asked for, so concurrent receivers, who get the same candidates in
    -- the same order, still find unlocked ones.
    CROSS JOIN LATERAL (
        SELECT m.id, m.group_id, m.visible_at, m.sent_at, m.receive_count, m.receive_base
        FROM pgonce.queue_message m
        WHERE m.ctid = c.ctid AND m.xmin = c.row_xmin AND m.id = c.id
        FOR UPDATE SKIP LOCKED
    ) m
    LIMIT $2
)
