-- Numbers for the rows the unsafe strategies insert by hand (each strategy
-- has its own organization; the guard's takes numbers through the service).
CREATE SEQUENCE IF NOT EXISTS public.race_guard_numbers;
