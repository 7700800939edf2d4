-- The pipeline round's own database: the incident run wants an empty one.
-- {name} is built from the round's scope (letters, digits, underscores).
CREATE DATABASE {name}
