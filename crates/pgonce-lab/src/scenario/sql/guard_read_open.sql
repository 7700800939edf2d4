-- The read set: the entity's OPEN incidents.
SELECT id FROM public.guard_incident
WHERE scope = $1 AND entity = $2 AND closed_at IS NULL
ORDER BY id
