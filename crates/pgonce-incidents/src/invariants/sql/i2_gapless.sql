-- I2: organizations whose numbers are not exactly 1..n (count, min, max,
-- distinct). Zero rows: I2 holds. (The unique index already forbids
-- duplicates; this also finds gaps.)
SELECT organization_id, count(*) AS count, min(number) AS min, max(number) AS max,
       count(DISTINCT number) AS distinct
  FROM incidents.incidents
 GROUP BY organization_id
HAVING min(number) <> 1 OR max(number) <> count(*) OR count(DISTINCT number) <> count(*)
 ORDER BY 1
