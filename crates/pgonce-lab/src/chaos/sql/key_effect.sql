INSERT INTO public.chaos_key_effect (scope, key, op) VALUES ($1, $2, $3)
