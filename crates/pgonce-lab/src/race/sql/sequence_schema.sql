-- One numbered table per strategy (standing for `incidents`), each with the
-- unique index on (scope, number) that backs every strategy, and the
-- declaration's other work. In `public` explicitly: the role may be named
-- like the `pgonce` schema, which the default search_path would pick.
CREATE TABLE public.race_seq_advisory_lock (
    org text NOT NULL, number bigint NOT NULL, UNIQUE (org, number));
CREATE TABLE public.race_seq_counter_row (
    org text NOT NULL, number bigint NOT NULL, UNIQUE (org, number));
CREATE TABLE public.race_seq_table_lock (
    org text NOT NULL, number bigint NOT NULL, UNIQUE (org, number));
CREATE TABLE public.race_seq_select_for_update (
    org text NOT NULL, number bigint NOT NULL, UNIQUE (org, number));
CREATE TABLE public.race_seq_work (org text NOT NULL, note text NOT NULL);
