TRUNCATE public.guard_incident RESTART IDENTITY
