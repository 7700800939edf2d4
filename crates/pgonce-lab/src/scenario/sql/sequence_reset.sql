-- Empties the scenario's tables and forgets its counter rows (keyed by the
-- numbered table and its columns, NumberedTable::counter_key), so a counter
-- never starts ahead of an empty scope.
TRUNCATE public.sequence_incident, public.sequence_work;
DELETE FROM pgonce.sequence_counters
WHERE sequence = '"public"."sequence_incident"("scope", "number")';
