-- The first fix one reaches for: right only while the rule is static ("one
-- OPEN incident per entity, always"), which it is in this race and is not
-- in the incident service (per-entity singleton-ness at run time). Only the
-- unique-index strategy's scope is covered, so the other strategies'
-- duplicates stay as evidence.
CREATE UNIQUE INDEX race_guard_one_open_incident
    ON public.guard_incident (scope, entity)
 WHERE closed_at IS NULL AND scope = 'race-guard/unique-index'
