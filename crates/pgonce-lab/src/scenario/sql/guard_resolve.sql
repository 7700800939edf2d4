-- Resolves whatever is OPEN for the entity.
UPDATE public.guard_incident SET closed_at = clock_timestamp()
WHERE scope = $1 AND entity = $2 AND closed_at IS NULL
