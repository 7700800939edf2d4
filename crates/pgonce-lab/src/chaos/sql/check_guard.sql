-- I1 over the round's history: pairs of incidents of one entity that were
-- OPEN at the same moment.
SELECT a.entity, a.id AS first, b.id AS second, a.op AS first_op, b.op AS second_op
FROM public.chaos_incident a
JOIN public.chaos_incident b
  ON b.scope = a.scope AND b.entity = a.entity AND b.id > a.id
WHERE a.scope = $1
  AND b.opened_at < COALESCE(a.closed_at, 'infinity')
  AND a.opened_at < COALESCE(b.closed_at, 'infinity')
ORDER BY a.id, b.id
