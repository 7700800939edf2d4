-- One row per processed message. A concurrent insert of the same key waits
-- for the first transaction: if it commits, this inserts nothing.
INSERT INTO pgonce.processed_messages (consumer, message_id)
VALUES ($1, $2)
ON CONFLICT (consumer, message_id) DO NOTHING
