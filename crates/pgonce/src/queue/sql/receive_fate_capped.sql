, fate AS (
    -- At most $5 deliveries: the pick looks at up to $2 messages, so that
    -- heads held back, moved or expired do not take the batch's places;
    -- deliveries past $5 are left untouched ('skipped'), in the standard
    -- pick's order (earliest visible first; among FIFO heads any order
    -- would do).
    SELECT id,
           CASE WHEN fate = 'delivered'
                     AND count(*) FILTER (WHERE fate = 'delivered')
                         OVER (ORDER BY visible_at, id ROWS UNBOUNDED PRECEDING) > $5
                THEN 'skipped' ELSE fate END AS fate
    FROM judged
