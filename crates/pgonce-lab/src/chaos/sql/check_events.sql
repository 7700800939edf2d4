-- I5 for one conditional append: events matching its condition (the
-- round's claim type and tag) committed after the decision's position and
-- below the append's own position.
SELECT position FROM pgonce.events
WHERE type = $1 AND tags @> $2 AND position > $3 AND position < $4
ORDER BY position
