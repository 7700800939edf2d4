    -- FIFO queue: only the head of each group, and only when visible. A head
    -- in flight (or delayed) is not visible, and everything behind it is not
    -- a head: at most one message per group in flight, in order. Other
    -- groups' heads are independent of it.
    -- OFFSET 0 keeps "is there an earlier message in the group?" a probe of
    -- queue_message_group per candidate: without it the planner may turn it
    -- into an anti-join, and on statistics taken while the queue was small
    -- it chose a nested loop over every pair of the queue's messages (2.3
    -- million comparisons, 453 ms, for 2,000 messages; 5.7 ms with the
    -- probe). tests/queue.rs,
    -- `a_fifo_receive_probes_each_head_on_stale_statistics`.
    SELECT m.id, m.sent_at, m.receive_count, m.receive_base
    FROM pgonce.queue_message m
    WHERE m.queue = $1 AND m.visible_at <= now()
      AND NOT EXISTS (
          SELECT 1 FROM pgonce.queue_message e
          WHERE e.queue = m.queue AND e.group_id = m.group_id AND e.id < m.id
          OFFSET 0)
    ORDER BY m.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
