-- I5 for one conditional append: events matching its condition (the
-- round's claim type and tag) committed after the decision's position and
-- below the append's own position, if the append committed (its event is
-- in the log: a pending append that rolled back, or whose commit failed,
-- drew a position and published nothing).
SELECT f.position FROM pgonce.events f
WHERE f.type = $1 AND f.tags @> $2 AND f.position > $3 AND f.position < $4
  AND EXISTS (SELECT 1 FROM pgonce.events own WHERE own.position = $4)
ORDER BY f.position
