, fate AS (
    -- The first statement of a receive looks at no more messages than it
    -- may deliver ($2): every fate stands (receive_fate_capped.sql is the
    -- follow-ups' step, which looks further).
    SELECT id, fate FROM judged
