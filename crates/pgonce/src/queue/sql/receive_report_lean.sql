UNION ALL
-- Picked, due for a fate this statement does not decide (receive_fate_lean.sql):
-- left as it was, for the full statement that the receive runs next.
SELECT fate, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM fate
WHERE fate = 'undecided'
UNION ALL
-- Picked and locked, but not acted on: a message the standard pick's
-- snapshot saw and this statement's did not (receive_report.sql).
SELECT 'unseen', fate.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM fate
WHERE fate.fate = 'delivered' AND fate.id NOT IN (SELECT id FROM delivered)
