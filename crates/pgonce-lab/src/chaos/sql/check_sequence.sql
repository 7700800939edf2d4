-- I2 in the table: the round's committed numbers, in order.
SELECT number, op FROM public.chaos_numbered WHERE scope = $1 ORDER BY number, op
