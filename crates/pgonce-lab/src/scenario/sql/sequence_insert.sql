-- The row carrying the number: the one write of a declaration that needs it.
INSERT INTO public.sequence_incident (scope, number, op) VALUES ($1, $2, $3)
