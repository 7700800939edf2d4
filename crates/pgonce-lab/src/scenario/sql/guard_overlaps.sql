-- I1 over a scope's history: pairs of incidents of one entity that were
-- OPEN at the same moment. Two intervals overlap when the later-opened one
-- opens before the earlier one closes, so each incident is joined only to
-- those opened during its own lifetime (an index range, not all pairs).
SELECT a.entity, a.id AS first, b.id AS second, a.op AS first_op, b.op AS second_op
FROM public.guard_incident a
JOIN public.guard_incident b
  ON b.scope = a.scope AND b.entity = a.entity
 AND b.opened_at >= a.opened_at
 AND b.opened_at < COALESCE(a.closed_at, 'infinity')
 AND (b.opened_at > a.opened_at OR b.id > a.id)
WHERE a.scope = $1
ORDER BY a.id, b.id
