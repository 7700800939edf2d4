-- I3: each job of the round, its status and how many times its side effect
-- was recorded.
SELECT j.id, j.status,
       (SELECT count(*) FROM public.chaos_job_effect e WHERE e.scope = $1 AND e.job_id = j.id) AS effects
FROM pgonce.jobs j
WHERE j.kind = $1
ORDER BY j.id
