-- I2 per scope: each of the scopes' committed numbers in order, with the
-- operation that wrote each (a number stored twice shows twice).
SELECT scope,
       array_agg(number ORDER BY number, op) AS numbers,
       array_agg(op ORDER BY number, op)     AS ops
FROM public.sequence_incident
WHERE scope = ANY($1)
GROUP BY scope
ORDER BY scope
