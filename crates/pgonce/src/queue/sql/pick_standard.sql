      -- Of this statement's kind: a fifo queue under the handle's name
      -- (its queue deleted by hand, another created) is none to the
      -- handle ('no_queue', receive_next_visible.sql).
      AND NOT fifo
), picked AS (
    -- Standard queue: the earliest visible messages, locked, skipping those
    -- another receiver holds (migration 0160: a function, so that this
    -- statement's plan does not depend on the limit and is kept).
    -- $4: messages to pass over; a standard queue holds none back (its
    -- messages have no group), so it is always empty here.
    SELECT p.id, p.group_id, p.visible_at, p.sent_at, p.receive_count, p.receive_base
    FROM pgonce.queue_pick_standard($1, $2, $4::bigint[]) AS p
)
