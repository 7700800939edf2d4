-- One write of a declaration's other work (paging, a channel, a timeline
-- entry): no number, no lock of the sequence's.
INSERT INTO public.sequence_work (scope, what) VALUES ($1, $2)
