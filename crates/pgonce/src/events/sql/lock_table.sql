-- Table-lock strategy: one writer at a time. EXCLUSIVE blocks every other
-- EXCLUSIVE and every INSERT (ROW EXCLUSIVE) but lets plain SELECTs read.
LOCK TABLE pgonce.events IN EXCLUSIVE MODE
