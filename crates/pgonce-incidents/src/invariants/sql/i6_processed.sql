-- I6: of the message ids $1, those the pipeline never finished with.
SELECT m FROM unnest($1::text[]) AS m
 WHERE NOT EXISTS (SELECT 1 FROM incidents.observations o WHERE o.message_id = m)
