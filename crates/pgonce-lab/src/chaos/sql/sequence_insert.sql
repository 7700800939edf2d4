INSERT INTO public.chaos_numbered (scope, number, op) VALUES ($1, $2, $3)
