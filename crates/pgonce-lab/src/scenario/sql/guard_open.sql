INSERT INTO public.guard_incident (scope, entity, op) VALUES ($1, $2, $3)
RETURNING id
