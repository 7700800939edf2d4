-- Every operation that left a row in the round's scope, for the check that
-- a failed operation wrote nothing.
SELECT op FROM public.guard_incident WHERE scope = $1
UNION ALL SELECT op FROM public.sequence_incident WHERE scope = $1
UNION ALL SELECT op FROM public.chaos_job_effect WHERE scope = $1
UNION ALL SELECT op FROM public.chaos_key_effect WHERE scope = $1
