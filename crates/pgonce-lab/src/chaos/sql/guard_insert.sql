INSERT INTO public.chaos_incident (scope, entity, op) VALUES ($1, $2, $3)
