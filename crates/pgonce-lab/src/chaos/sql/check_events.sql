-- I5 for one conditional append whose decision saw no claim: any other
-- claim (the round's claim type and tag) below the append's own position
-- is forbidden. One above the decision's position broke the condition;
-- one at or below it committed after the decision had read past its
-- position, so the decision was stale when the condition was checked.
-- Counted only if the append committed (its event is in the log: a
-- pending append that rolled back, or whose commit failed, drew a
-- position and published nothing).
SELECT f.position FROM pgonce.events f
WHERE f.type = $1 AND f.tags @> $2 AND f.position < $3
  AND EXISTS (SELECT 1 FROM pgonce.events own WHERE own.position = $3)
ORDER BY f.position
