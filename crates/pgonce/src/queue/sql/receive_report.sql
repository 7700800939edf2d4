UNION ALL
SELECT 'dead_lettered', id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, dead_letter_queue FROM moved
UNION ALL
SELECT 'expired', id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM expired
UNION ALL
SELECT fate, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM fate
WHERE fate IN ('held', 'skipped')
UNION ALL
-- Picked and locked, but not acted on: a message the standard pick's
-- snapshot saw and this statement's did not (committed in between by a
-- transaction that began before this one; migration 0160). It took a
-- place of the batch and its lock turned other receivers away; the
-- receive looks again, and wakes them.
SELECT 'unseen', fate.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM fate
WHERE fate.fate IN ('delivered', 'dead_lettered', 'expired')
  AND fate.id NOT IN (SELECT id FROM delivered UNION ALL SELECT id FROM moved
                      UNION ALL SELECT id FROM expired)
