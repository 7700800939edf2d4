INSERT INTO public.bench_seq_incidents (org, number) VALUES ($1, $2)
