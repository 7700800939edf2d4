INSERT INTO public.chaos_job_effect (scope, job_id, op) VALUES ($1, $2, $3)
