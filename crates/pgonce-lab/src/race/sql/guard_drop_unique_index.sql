DROP INDEX IF EXISTS public.race_guard_one_open_incident
