-- I3: every job of the round, found by its row or by a side effect of the
-- round naming it, with its status (NULL: it has no row) and how many
-- times its side effect was recorded. A job whose row is gone still shows
-- here if its effect ran; the checker finds the others from the history.
SELECT ids.id, j.status, count(e.job_id) AS effects
FROM (SELECT id FROM pgonce.jobs WHERE kind = $1
      UNION
      SELECT job_id FROM public.chaos_job_effect WHERE scope = $1) AS ids
LEFT JOIN pgonce.jobs j ON j.id = ids.id AND j.kind = $1
LEFT JOIN public.chaos_job_effect e ON e.scope = $1 AND e.job_id = ids.id
GROUP BY ids.id, j.status
ORDER BY ids.id
