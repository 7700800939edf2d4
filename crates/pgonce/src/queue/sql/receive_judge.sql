, judged AS (
    -- What each picked message's fate would be.
    -- A FIFO message moved to the dead-letter queue goes to the back of its
    -- group there, as a send to that queue would: under the group's lock in
    -- the dead-letter queue (send.sql's key), held until the receive
    -- commits, with a position drawn after it was granted (moved). So
    -- positions in the dead-letter queue's group follow commit order, and
    -- a moved message never lands ahead of one in flight there (migration
    -- 0132). The lock is only tried: when a sender holds it, the message
    -- is held back (neither moved nor delivered, left as it was for a
    -- later receive), so a receive never waits for another transaction,
    -- which would let the leases it hands out run while it waits and could
    -- deadlock with a sender that locks several groups in its own order.
    -- Only picked rows get here (after the pick's LIMIT), so the receive
    -- tries at most one lock per message it picked.
    SELECT picked.id, picked.visible_at,
           CASE WHEN picked.sent_at <= now() - q.retention_ms * interval '1 millisecond' THEN 'expired'
                WHEN q.max_receive_count IS NOT NULL
                     AND picked.receive_count - picked.receive_base >= q.max_receive_count
                THEN CASE WHEN picked.group_id IS NULL
                            OR pg_try_advisory_xact_lock(pgonce.lock_key(
                                   'pgonce.queue/' || q.dead_letter_queue, picked.group_id))
                          THEN 'dead_lettered' ELSE 'held' END
                ELSE 'delivered' END AS fate
    FROM picked, q
)