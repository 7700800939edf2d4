-- The isolation level of the caller's transaction: 'read committed',
-- 'repeatable read' or 'serializable'.
SELECT current_setting('transaction_isolation')
