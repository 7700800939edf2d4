-- I6: of the queue's message ids $1 (observations sent without a
-- producer's id), those the pipeline never finished with. The ledger keys
-- them `queue:<id>` (model::queue_ledger_key).
SELECT m FROM unnest($1::text[]) AS m
 WHERE NOT EXISTS (SELECT 1 FROM incidents.observations o WHERE o.message_id = 'queue:' || m)
