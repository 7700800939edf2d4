-- Drops the pipeline round's database, ending any connection left in it.
DROP DATABASE IF EXISTS {name} WITH (FORCE)
