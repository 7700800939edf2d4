//! Per-scope gapless numbers (P2, for concurrent incident declarations in one
//! organization): incident 1, 2, 3... of each organization, taken inside the
//! caller's transaction.
//!
//! # The guarantee (I2)
//!
//! In every scope the committed numbers are unique and gapless, `1..=n`, and
//! a declaration in one scope never waits for a declaration in another
//! (except under [`Strategy::TableLock`], the baseline). It needs:
//!
//! * a **unique index on (scope, number)** of the numbered table: it backs
//!   every strategy, and turns any mistake into an error rather than a
//!   duplicate ([`Sequence::check_schema`] checks that it exists);
//! * the number taken **inside the transaction that inserts the row**
//!   carrying it: the scope stays locked until that transaction ends, and a
//!   rollback frees the number, so the next declaration gets it again (no
//!   gap, unlike a PostgreSQL `SEQUENCE`, which is not transactional);
//! * **READ COMMITTED** for the max + 1 strategies: the statement that reads
//!   `max(number)` must take its snapshot after the lock was granted, and only
//!   READ COMMITTED takes a snapshot per statement. Under REPEATABLE READ or
//!   SERIALIZABLE the snapshot may predate the lock, the max is stale, and
//!   two transactions compute the same number. pgonce checks
//!   `transaction_isolation` before it locks anything and returns
//!   [`Error::WrongIsolation`]: a clear error, never a duplicate;
//! * pgonce's migrations applied ([`crate::migrate()`]): check, lock and
//!   max + 1 run server-side in `pgonce.sequence_take` (migration 0060), a
//!   `VOLATILE` function, which under READ COMMITTED takes a fresh snapshot
//!   for each statement it runs, so the max is read after the lock was
//!   granted without a client round trip in between;
//! * every row of the table inserted through this module (or under the same
//!   lock), and numbers never deleted: a hole left by a delete stays a hole.
//!   A transaction that takes a number and commits without inserting it
//!   leaves a gap under [`Strategy::CounterRow`] (the counter moved on);
//!   the max + 1 strategies hand that number out again.
//!
//! # The numbered table
//!
//! The caller keeps its numbers in its own table (such as `incidents`),
//! named by a validated [`NumberedTable`]: table, scope column and number
//! column, quoted as identifiers in every statement. The scope value is bound
//! as a parameter of the column's type (`i64`, `uuid::Uuid`, `&str`...).
//!
//! # Behind a transaction pooler
//!
//! Every strategy works behind PgBouncer in `pool_mode = transaction`: each
//! lock it takes (advisory, row, table) is transaction-level and lasts
//! exactly as long as the server connection is the transaction's, and no
//! step depends on session state. Like the rest of pgonce it needs the
//! pooler to carry prepared statements (`max_prepared_statements`, PgBouncer
//! 1.21 or newer). Without it a take fails with [`Error::Pooler`] when
//! PostgreSQL refuses the mix-up of statement names, but not always: a
//! server connection holding another client's statement of the same name
//! and parameters runs that one instead, and what it answers is not a
//! number taken under the lock. Such a pooler is not supported.
//!
//! # Scope values
//!
//! A scope is stored and indexed as the database has it: in the numbered
//! table's unique index on (scope, number), which every strategy relies on,
//! and, under [`Strategy::CounterRow`], as text in the primary key of
//! `pgonce.sequence_counters` beside the counter key
//! ([`NumberedTable::counter_key`], up to 517 bytes for names of 63 `"`).
//! A B-tree entry holds at most 2704 bytes once compressed; past it the
//! insert fails with SQLSTATE 54000 and aborts the caller's transaction.
//! Incompressible text scopes fit up to 2684 bytes in a (text, bigint)
//! index, and up to 2652 bytes in the counter row's key for a table named
//! `public.incidents` (fewer for longer names). So a scope's `Display` form
//! (the value itself for text) is refused with [`Error::Invalid`] before any
//! statement when it is longer than [`Sequence::MAX_SCOPE_BYTES`], which
//! fits every strategy whatever the names and the content, or holds NUL,
//! which PostgreSQL's text cannot. The empty string, non-BMP characters and
//! integers at the ends of their range are values like any other: stored
//! and read back equal. Text is compared byte for byte: the same text in
//! two Unicode normalisation forms is two scopes.
//!
//! The scope column's equality must be its `Display` form's: the locks and
//! the counter row are keyed by that text, the numbers by the column. In a
//! column where two spellings are one value (`char(n)`, which ignores
//! trailing spaces; `citext`; a nondeterministic collation; a float's `0`
//! and `-0`), the second spelling takes a lock and a count of its own,
//! computes a number the first already holds, and is refused by the
//! unique index every time: no duplicate, but never a number. Use `text`,
//! `varchar` or an integer column, or pass scopes in one canonical spelling.
//! A scope whose type does not compare with the column's at all (an
//! integer on a text column) is [`Error::Invalid`].
//!
//! # The short window
//!
//! Within one scope, gapless numbers serialize declarations for as long as
//! the scope's lock is held, and it is held until COMMIT: a number taken at
//! the start of a long declaration transaction (the naive order, number
//! first) makes every other declaration of that organization wait for all of
//! it. So the natural API, [`Sequence::commit_numbered`], takes the number as
//! the *last* step: the caller does its other work in the open transaction,
//! then hands the transaction over with the one write that needs the number;
//! pgonce locks the scope, computes the number, runs that write and commits.
//! The lock is held for the number's return, the write and the COMMIT (two
//! round trips and a half, and the commit's WAL flush) whatever the rest of
//! the transaction did. [`Sequence::next`] is the low-level step for callers
//! who must know the number earlier; it holds the scope for the rest of the
//! transaction, which `pgonce bench sequence` measures.
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool, org: i64) -> pgonce::Result<()> {
//! use pgonce::{NumberedTable, Sequence, SequenceConfig};
//! let incidents = Sequence::new(
//!     NumberedTable::new("public.incidents", "organization_id", "number")?,
//!     SequenceConfig::default(), // advisory lock per scope + max + 1
//! )?;
//! let mut tx = pgonce::begin(&pool, pgonce::IsolationLevel::ReadCommitted).await?;
//! // ... the declaration's other work, in the same transaction ...
//! let declared = incidents
//!     .commit_numbered(tx, &org, async |conn: &mut sqlx::PgConnection, number: i64| {
//!         sqlx::query("INSERT INTO incidents (organization_id, number) VALUES ($1, $2)")
//!             .bind(org)
//!             .bind(number)
//!             .execute(conn)
//!             .await?;
//!         Ok(())
//!     })
//!     .await?;
//! println!("incident #{} (scope locked for {:?})", declared.number, declared.held);
//! # Ok(()) }
//! ```
//!
//! # Strategies
//!
//! | strategy | lock | scopes independent | isolation |
//! |---|---|---|---|
//! | [`Strategy::AdvisoryLock`] (default) | `pg_advisory_xact_lock` per (table, scope), then max + 1 | yes | READ COMMITTED |
//! | [`Strategy::CounterRow`] | row lock on the scope's row of `pgonce.sequence_counters` | yes | any (under REPEATABLE READ / SERIALIZABLE a declarer that waited for the row aborts with a retryable [`Error::SerializationFailure`] when the holder commits: never a duplicate) |
//! | [`Strategy::TableLock`] | `LOCK TABLE ... IN EXCLUSIVE MODE`, then max + 1 | no: blocks every write to the table | READ COMMITTED |
//! | [`Strategy::SelectForUpdate`] | `SELECT ... FOR UPDATE` of the scope's rows, then max + 1 | yes | READ COMMITTED; an empty scope has no rows to lock, so its first declarations race and all but one fail with [`Error::NumberTaken`] |
//!
//! Strategies do not lock each other out: each takes only its own lock.
//! They may number one scope in turn (each continues the others' numbers),
//! but two of them numbering it at the same moment (a deploy that changes
//! the strategy, old and new versions running side by side) compute the
//! same number, and the unique index refuses the one that commits second
//! with [`Error::NumberTaken`]: never a duplicate or a gap, and its retry
//! takes the next number.
//!
//! # Cancel safety
//!
//! [`Sequence::commit_numbered`] owns the declaration's transaction:
//! dropped at any await, it drops the transaction, which rolls back (the
//! number is free again, nothing of the declaration is written), unless
//! its COMMIT was already sent, in which case the number and its row are
//! committed together. Dropped while it waits for the scope, the wait goes
//! on on the server; a pooled connection goes back to the pool only once it
//! has ended and the transaction rolled back, so the scope is free again
//! then. On a connection of the caller's own the ROLLBACK is sent when
//! that connection is next used: until then a scope granted meanwhile stays
//! locked, so use or close it.
//! [`Sequence::next`] runs in the caller's transaction: dropped, the
//! number may or may not be taken, and the scope may be locked: roll the
//! transaction back.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::PgTransactionManager;
use sqlx::{AssertSqlSafe, Encode, PgConnection, Postgres, Transaction, Type};
use sqlx_core::transaction::TransactionManager;

use crate::error::{Error, Result, sqlstate, sqlstate_of};
use crate::lock::LockKey;

/// How a [`Sequence`] serializes the declarations of one scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Strategy {
    /// A transaction-level advisory lock per (table, scope), then
    /// `max(number) + 1` in a statement of its own. Scopes never wait for
    /// each other; needs READ COMMITTED. The default.
    #[default]
    AdvisoryLock,
    /// An upsert that increments the scope's row in
    /// `pgonce.sequence_counters` (created from the table's max on first
    /// use, and never left behind it, so the other strategies can number
    /// the same scope in between); the row lock serializes the scope. Any
    /// isolation level. The row is keyed by the table *and* its scope and
    /// number columns, so two sequences of one table (numbers per
    /// organization and per team, say) never move each other's counters.
    CounterRow,
    /// `LOCK TABLE ... IN EXCLUSIVE MODE`, then max + 1: what the `sequenced`
    /// gem does. Correct, but every declaration of every scope (and every
    /// other write to the table) waits for it. A baseline.
    TableLock,
    /// `SELECT ... FOR UPDATE` of the scope's existing rows, then max + 1:
    /// the usual first attempt at narrowing the table lock to one scope.
    /// The rows are locked in number order, so two takers of a scope queue
    /// at its lowest row whatever their plans (in plan order they could
    /// deadlock). Locks nothing in an empty scope, so the first
    /// declarations of a scope can compute the same number; the unique
    /// index rejects the losers with [`Error::NumberTaken`]. A baseline.
    SelectForUpdate,
}

impl Strategy {
    /// Every strategy, the default first.
    pub const ALL: [Strategy; 4] = [
        Strategy::AdvisoryLock,
        Strategy::CounterRow,
        Strategy::TableLock,
        Strategy::SelectForUpdate,
    ];

    /// A stable name: `advisory-lock`, `counter-row`, `table-lock`,
    /// `select-for-update` (metrics labels, reports).
    pub const fn name(self) -> &'static str {
        match self {
            Strategy::AdvisoryLock => "advisory-lock",
            Strategy::CounterRow => "counter-row",
            Strategy::TableLock => "table-lock",
            Strategy::SelectForUpdate => "select-for-update",
        }
    }

    /// Whether the strategy is correct under `isolation` (the value of
    /// `transaction_isolation`: `read committed`, `repeatable read`,
    /// `serializable`).
    pub fn accepts(self, isolation: &str) -> bool {
        match self {
            Strategy::CounterRow => true,
            _ => isolation == READ_COMMITTED,
        }
    }

    /// The level [`Error::WrongIsolation`] names, upper case as its docs
    /// say (`accepts` compares PostgreSQL's lower-case spelling).
    const fn needs(self) -> &'static str {
        match self {
            Strategy::CounterRow => "any",
            _ => "READ COMMITTED",
        }
    }
}

/// What [`Sequence::check_schema`] reads of the numbered table.
#[derive(sqlx::FromRow)]
struct SchemaRow {
    unique_index: bool,
    number_type: Option<String>,
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

const READ_COMMITTED: &str = "read committed";

/// The caller's table that holds the numbers: `schema.table`, its scope
/// column and its number column (a `bigint`, an `int` or a `smallint`:
/// past its type's largest value the scope is [`Error::SequenceExhausted`]).
///
/// Names are taken as PostgreSQL stores them (unquoted names are stored in
/// lower case) and are always quoted, so any name is safe. A table given
/// without a schema is in `public`: the name is part of the advisory lock key
/// and of the counter row, so two processes must spell the same table the
/// same way, and an explicit schema makes that so. Two sequences of one
/// table (each with its own scope and number columns) share the lock
/// namespace: declarations of equal scope values in the two wait for each
/// other, which costs time, never a wrong number; their counter rows are
/// apart, as the columns are part of the counter's key. (A role named like an
/// existing schema, `pgonce` for instance, creates unqualified tables in
/// that schema under the default `search_path`: one more reason to name the
/// schema.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumberedTable {
    schema: String,
    table: String,
    scope_column: String,
    number_column: String,
}

impl NumberedTable {
    /// `table` is `name` or `schema.name` (one dot at most). Every name must
    /// be 1 to 63 bytes with no NUL; otherwise [`Error::Invalid`].
    pub fn new(table: &str, scope_column: &str, number_column: &str) -> Result<NumberedTable> {
        let (schema, name) = match table.split_once('.') {
            Some((schema, name)) => (schema, name),
            None => ("public", table),
        };
        if name.contains('.') {
            return Err(Error::invalid(
                "numbered table",
                "more than one `.` in the name",
            ));
        }
        for part in [schema, name, scope_column, number_column] {
            identifier(part)?;
        }
        if scope_column == number_column {
            return Err(Error::invalid(
                "numbered table",
                "scope and number must be different columns",
            ));
        }
        Ok(NumberedTable {
            schema: schema.into(),
            table: name.into(),
            scope_column: scope_column.into(),
            number_column: number_column.into(),
        })
    }

    /// `schema.table`, unquoted: the sequence's name in lock keys and
    /// errors.
    pub fn name(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    /// The key of this table's counter rows ([`Strategy::CounterRow`]):
    /// `"schema"."table"("scope", "number")`, every name quoted, so two
    /// sequences of one table get different keys and no two spellings
    /// collide.
    pub fn counter_key(&self) -> String {
        format!(
            "{}({}, {})",
            self.quoted(),
            quote(&self.scope_column),
            quote(&self.number_column)
        )
    }

    fn quoted(&self) -> String {
        format!("{}.{}", quote(&self.schema), quote(&self.table))
    }
}

fn identifier(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 63 || name.contains('\0') {
        return Err(Error::invalid(
            "identifier",
            format!("{name:?} must be 1 to 63 bytes with no NUL"),
        ));
    }
    Ok(())
}

/// `"name"`, with `"` doubled: always a single identifier.
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `E'text'`, with `\` and `'` doubled: always a single string constant,
/// whatever `standard_conforming_strings` says (an `E''` string always reads
/// backslash escapes). Names hold no NUL (checked by [`identifier`]).
fn literal(text: &str) -> String {
    format!("E'{}'", text.replace('\\', "\\\\").replace('\'', "''"))
}

/// `template` with each placeholder replaced by its value, in one pass:
/// text put in is never scanned again, so a name that looks like a
/// placeholder (`{table_name}`) stays a name. (Chained `str::replace` would
/// substitute inside names already put in, and a crafted name could close
/// its literal and run SQL.) No crate does this single-pass substitution
/// for SQL text we own; a template engine would be far more than it needs.
fn fill(template: &str, values: &[(&str, String)]) -> String {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(at) = rest.find('{') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        match values.iter().find(|(key, _)| rest.starts_with(key)) {
            Some((key, value)) => {
                out.push_str(value);
                rest = &rest[key.len()..];
            }
            None => {
                out.push('{');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Settings of a [`Sequence`].
#[derive(Debug, Clone, Default)]
pub struct SequenceConfig {
    /// How a scope is serialized. Default: [`Strategy::AdvisoryLock`].
    pub strategy: Strategy,
}

/// A value a scope column can be bound from and named by (`i64`, `&str`,
/// `String`, `uuid::Uuid`...). Its `Display` form names the scope in lock
/// keys and counter rows, so it must be the same for equal values.
///
/// A NULL scope cannot be given: `Option<T>` has no `Display`, so it is no
/// scope value (a NULL would match no row, and every declaration of "no
/// scope" would get number 1).
///
/// ```compile_fail
/// # async fn f(seq: pgonce::Sequence, mut tx: sqlx::Transaction<'_, sqlx::Postgres>) {
/// seq.next(&mut tx, &None::<i64>).await;
/// # }
/// ```
pub trait ScopeValue: for<'q> Encode<'q, Postgres> + Type<Postgres> + fmt::Display + Sync {}

impl<T> ScopeValue for T where T: for<'q> Encode<'q, Postgres> + Type<Postgres> + fmt::Display + Sync
{}

/// What `sequence/sql/take.sql` returns: the transaction's isolation
/// level, the number (`None`: the level is wrong for the strategy and
/// nothing was locked), and the seconds from the lock's grant to the
/// statement's end.
#[derive(sqlx::FromRow)]
struct TakeRow {
    isolation: String,
    number: Option<i64>,
    after_grant: Option<f64>,
}

/// Gapless numbers per scope in a caller's table. Cheap to clone; build it
/// once and share it.
#[derive(Debug, Clone)]
pub struct Sequence {
    name: Arc<str>,
    /// [`NumberedTable::counter_key`], the `sequence` of its counter rows.
    counter_key: Arc<str>,
    strategy: Strategy,
    table: NumberedTable,
    sql: Arc<Statements>,
}

/// The statements of one sequence, built once from the `.sql` files with the
/// quoted names put in.
#[derive(Debug)]
struct Statements {
    /// Isolation check, lock and max + 1 in one call of
    /// `pgonce.sequence_take` (migration 0060), for the max + 1 strategies.
    take: String,
    counter: String,
}

/// A number taken by [`Sequence::next`], with how long its lock took.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Taken {
    /// The scope's next number.
    pub number: i64,
    /// How long the lock statement waited (and ran), up to the grant.
    pub waited: Duration,
    /// When the scope's lock was granted (the number's arrival less the
    /// server-side time after the grant); it is held until the transaction
    /// ends.
    pub granted_at: Instant,
}

/// What [`Sequence::commit_numbered`] committed.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Numbered<T> {
    /// The number the write stored, now committed.
    pub number: i64,
    /// What the write returned.
    pub value: T,
    /// How long the scope's lock was waited for.
    pub waited: Duration,
    /// How long the scope's lock was held: from grant to COMMIT done.
    pub held: Duration,
}

impl Sequence {
    /// The longest scope, in bytes of its `Display` form (the UTF-8 of a
    /// text scope). Its index entries fit whatever the scope's content (an
    /// incompressible one included) and whatever the table's names: the
    /// numbered table's (scope, number) entry, and the counter row's
    /// (counter key, scope) entry with a counter key of 517 bytes, the
    /// longest four names of 63 bytes quote to, both within a B-tree
    /// entry's 2704 bytes.
    pub const MAX_SCOPE_BYTES: usize = 2048;

    /// A sequence over `table`. Builds its statements; touches no database
    /// (see [`Sequence::check_schema`]).
    pub fn new(table: NumberedTable, config: SequenceConfig) -> Result<Sequence> {
        let sql = Statements {
            take: fill(
                include_str!("sequence/sql/take.sql"),
                &[
                    ("{strategy}", literal(config.strategy.name())),
                    ("{schema_name}", literal(&table.schema)),
                    ("{table_name}", literal(&table.table)),
                    ("{scope_name}", literal(&table.scope_column)),
                    ("{number_name}", literal(&table.number_column)),
                ],
            ),
            counter: fill(
                include_str!("sequence/sql/counter.sql"),
                &[
                    ("{table}", table.quoted()),
                    ("{scope}", quote(&table.scope_column)),
                    ("{number}", quote(&table.number_column)),
                ],
            ),
        };
        Ok(Sequence {
            name: table.name().into(),
            counter_key: table.counter_key().into(),
            strategy: config.strategy,
            table,
            sql: Arc::new(sql),
        })
    }

    /// The strategy this sequence uses.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The table this sequence numbers.
    pub fn table(&self) -> &NumberedTable {
        &self.table
    }

    /// The advisory lock key of `scope` ([`Strategy::AdvisoryLock`]):
    /// namespace `pgonce.sequence/<schema>.<table>`, key the scope's
    /// `Display` form (see [`LockKey`] for the derivation).
    pub fn lock_key(&self, scope: &impl ScopeValue) -> Result<LockKey> {
        LockKey::new(
            &format!("pgonce.sequence/{}", self.name),
            &scope.to_string(),
        )
    }

    /// Checks that the table exists with a unique index on exactly
    /// (scope, number), the index every strategy relies on to turn a mistake
    /// into an error rather than a duplicate, and that its number column is
    /// a `smallint`, an `integer` or a `bigint`: not a `numeric`, nor a
    /// domain, past whose largest value or `CHECK` the next number would be
    /// handed out and the caller's insert refused with a raw error, where
    /// these types end in [`Error::SequenceExhausted`]. [`Error::Invalid`]
    /// if not.
    pub async fn check_schema<'c>(&self, conn: impl sqlx::PgExecutor<'c>) -> Result<()> {
        let SchemaRow {
            unique_index,
            number_type,
        } = sqlx::query_as(concat!(
            "SELECT (",
            include_str!("sequence/sql/unique_index.sql"),
            ") AS unique_index, (",
            include_str!("sequence/sql/number_type.sql"),
            ") AS number_type"
        ))
        .bind(self.table.quoted())
        .bind(&self.table.scope_column)
        .bind(&self.table.number_column)
        .fetch_one(conn)
        .await?;
        if !unique_index {
            return Err(Error::invalid(
                "numbered table",
                format!(
                    "{} has no unique index on ({}, {})",
                    self.name, self.table.scope_column, self.table.number_column
                ),
            ));
        }
        match number_type.as_deref() {
            Some("smallint" | "integer" | "bigint") => Ok(()),
            other => Err(Error::invalid(
                "numbered table",
                format!(
                    "{}'s number column {} is {}: it must be a smallint, an integer or a bigint",
                    self.name,
                    self.table.number_column,
                    other.unwrap_or("missing")
                ),
            )),
        }
    }

    /// Takes the next number of `scope` inside `tx` and returns it; the
    /// scope stays locked until `tx` commits or rolls back.
    ///
    /// Insert the row carrying the number in the same transaction. Every
    /// other declaration of the scope waits from now until `tx` ends: call
    /// this as late as the transaction allows, or use
    /// [`Sequence::commit_numbered`], which calls it last by construction.
    ///
    /// Errors: [`Error::WrongIsolation`] (before any lock is taken) when the
    /// strategy cannot be correct at `tx`'s isolation level;
    /// [`Error::SerializationFailure`] for a deadlock or a serialization
    /// failure (retry the transaction); [`Error::SequenceExhausted`] when
    /// the scope's next number is past its column's type;
    /// [`Error::Invalid`] (before any statement, `tx` untouched) for a scope
    /// longer than [`Sequence::MAX_SCOPE_BYTES`] or holding NUL.
    ///
    /// Cancel safety: dropping the future mid-way leaves `tx` in an unknown
    /// state; roll it back.
    pub async fn next(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        scope: &impl ScopeValue,
    ) -> Result<Taken> {
        let started = Instant::now();
        // Before any statement: a scope the indexes cannot hold would fail
        // in the database and abort `tx` (see "Scope values" above).
        let scope_text = scope.to_string();
        crate::text::check_text("sequence scope", &scope_text, Self::MAX_SCOPE_BYTES)?;
        if self.strategy == Strategy::CounterRow {
            // Correct at every isolation level, so nothing to check: the
            // upsert both waits for the row lock and yields the number.
            let number = sqlx::query_scalar(AssertSqlSafe(self.sql.counter.as_str()))
                .bind(&*self.counter_key)
                .bind(scope_text)
                .bind(scope)
                .fetch_one(&mut **tx)
                .await
                .map_err(|e| self.exhausted(e, scope))?;
            return Ok(self.taken(number, started, Instant::now()));
        }
        // One round trip: isolation check, lock, then max + 1 in a statement
        // of its own inside `pgonce.sequence_take` (a VOLATILE function, so
        // under READ COMMITTED that statement's snapshot is taken after the
        // lock was granted; see migrations/0060_sequence_take.sql).
        let key = match self.strategy {
            Strategy::AdvisoryLock => self.lock_key(scope)?.as_i64(),
            _ => 0,
        };
        let TakeRow {
            isolation,
            number,
            after_grant,
        } = sqlx::query_as(AssertSqlSafe(self.sql.take.as_str()))
            .bind(key)
            .bind(scope)
            .fetch_one(&mut **tx)
            .await
            .map_err(|e| self.exhausted(e, scope))?;
        let returned = Instant::now();
        let Some(number) = number else {
            // The function locked nothing: the level is wrong.
            metrics::counter!("pgonce_sequence_wrong_isolation_total", "strategy" => self.strategy.name())
                .increment(1);
            return Err(Error::WrongIsolation {
                strategy: self.strategy.name(),
                needed: self.strategy.needs(),
                found: isolation,
            });
        };
        // The server's clock timed grant to return; take it off our receipt
        // time (never before the call started).
        let after_grant = Duration::try_from_secs_f64(after_grant.unwrap_or(0.0).max(0.0))
            .unwrap_or_default()
            .min(returned - started);
        Ok(self.taken(number, started, returned - after_grant))
    }

    /// [`Error::SequenceExhausted`] for the one value out of range the
    /// statements taking a number can meet, the scope's next number (its
    /// maximum + 1, or its counter row's, computed in the number column's
    /// type) (the scope is compared with its column across types, never
    /// converted);
    /// any other error as it is.
    /// The typed error of a take that failed: the scope's numbers past its
    /// column's type, or a scope whose type does not compare with its
    /// column's (an integer scope on a text column: PostgreSQL has no
    /// `text = bigint`), which no retry fixes.
    fn exhausted(&self, e: sqlx::Error, scope: &impl ScopeValue) -> Error {
        if sqlstate_of(&e).as_deref() == Some(sqlstate::NUMERIC_VALUE_OUT_OF_RANGE) {
            tracing::warn!(sequence = %self.name, %scope, "scope exhausted: its next number is past its column's type");
            return Error::SequenceExhausted {
                sequence: self.name.to_string(),
                scope: scope.to_string(),
            };
        }
        // 42883 is also a function that does not exist (a schema not
        // migrated), or the number column's `+` (a column of another type
        // than the integers): only the comparison, `=`, is the scope's type.
        if let Some(d) = e.as_database_error()
            && d.code().as_deref() == Some(sqlstate::UNDEFINED_FUNCTION)
            && d.message()
                .strip_prefix("operator does not exist: ")
                .is_some_and(|operator| operator.contains(" = "))
        {
            return Error::invalid(
                "sequence scope",
                format!(
                    "its type does not compare with column {} of {}: {}",
                    self.table.scope_column,
                    self.table.quoted(),
                    d.message()
                ),
            );
        }
        e.into()
    }

    fn taken(&self, number: i64, started: Instant, granted_at: Instant) -> Taken {
        let waited = granted_at - started;
        metrics::counter!("pgonce_sequence_numbers_total", "strategy" => self.strategy.name())
            .increment(1);
        metrics::histogram!("pgonce_sequence_lock_wait_seconds", "strategy" => self.strategy.name())
            .record(waited.as_secs_f64());
        Taken {
            number,
            waited,
            granted_at,
        }
    }

    /// Finishes a declaration: takes the next number of `scope` as the last
    /// step of `tx`, runs `write(conn, number)` (the statement that stores
    /// the number), and commits. The scope is locked only from the number
    /// to the COMMIT, whatever `tx` did before.
    ///
    /// On any error `tx` is rolled back, so nothing of the declaration is
    /// committed and the number is free again. A unique violation on the
    /// numbered table raised by `write` becomes [`Error::NumberTaken`] (only
    /// possible under [`Strategy::SelectForUpdate`], when rows are written
    /// without this module, or when a sequence of another strategy numbers
    /// the same scope at the same moment: see "Strategies" in the module
    /// docs). Other errors as in [`Sequence::next`].
    ///
    /// `tx` must be a top-level transaction: a savepoint (a transaction
    /// begun inside an open one, `sqlx::Acquire::begin(&mut tx)`) is refused with [`Error::NestedTransaction`] before
    /// anything is locked, and rolled back. Its "commit" only releases the
    /// savepoint: the number would not be committed, and the scope would
    /// stay locked until the outer transaction ends. (sqlx tracks the depth
    /// of the transactions it began; a `SAVEPOINT` run by hand is not seen.)
    pub async fn commit_numbered<T>(
        &self,
        mut tx: Transaction<'_, Postgres>,
        scope: &impl ScopeValue,
        write: impl AsyncFnOnce(&mut PgConnection, i64) -> Result<T>,
    ) -> Result<Numbered<T>> {
        // 1 in a top-level transaction, 2 and more in savepoints.
        let depth = PgTransactionManager::get_transaction_depth(&tx);
        if depth > 1 {
            let _ = tx.rollback().await;
            return Err(Error::NestedTransaction {
                operation: "commit_numbered",
                depth,
            });
        }
        // On error, roll back at once: a dropped sqlx transaction sends its
        // ROLLBACK only when the connection is next used, and the scope
        // would stay locked until then.
        let taken = match self.next(&mut tx, scope).await {
            Ok(taken) => taken,
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(e);
            }
        };
        let value = match write(&mut tx, taken.number).await {
            Ok(value) => value,
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(self.number_taken(e, scope, taken.number));
            }
        };
        if let Err(e) = tx.commit().await {
            return Err(self.number_taken(e.into(), scope, taken.number));
        }
        Ok(Numbered {
            number: taken.number,
            value,
            waited: taken.waited,
            held: taken.granted_at.elapsed(),
        })
    }

    /// Whether a unique violation's detail, `Key (a, b)=(...) already
    /// exists.`, names exactly the (scope, number) key: a violation of
    /// another unique index of the table is not a taken number.
    fn is_scope_number_key(&self, detail: &str) -> bool {
        let Some(columns) = detail
            .strip_prefix("Key (")
            .and_then(|d| d.split_once(")=("))
            .map(|(columns, _)| columns)
        else {
            return false;
        };
        let mut names: Vec<String> = columns
            .split(", ")
            .map(|c| c.trim_matches('"').replace("\"\"", "\""))
            .collect();
        names.sort();
        let mut ours = vec![
            self.table.scope_column.clone(),
            self.table.number_column.clone(),
        ];
        ours.sort();
        names == ours
    }

    /// Turns a unique violation of the numbered table's (scope, number)
    /// index into [`Error::NumberTaken`]; any other error (another unique
    /// index of the same table included) passes through.
    pub fn number_taken(&self, error: Error, scope: &impl ScopeValue, number: i64) -> Error {
        let Error::Database(e) = &error else {
            return error;
        };
        let on_our_index = e
            .as_database_error()
            .and_then(|d| d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
            .is_some_and(|d| {
                d.schema() == Some(self.table.schema.as_str())
                    && d.table() == Some(self.table.table.as_str())
                    && d.detail().is_some_and(|k| self.is_scope_number_key(k))
            });
        if sqlstate_of(e).as_deref() == Some(sqlstate::UNIQUE_VIOLATION) && on_our_index {
            tracing::warn!(sequence = %self.name, %scope, number, strategy = %self.strategy, "number already taken in scope");
            metrics::counter!("pgonce_sequence_number_taken_total", "strategy" => self.strategy.name())
                .increment(1);
            return Error::NumberTaken {
                sequence: self.name.to_string(),
                scope: scope.to_string(),
                number,
            };
        }
        error
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_and_quoted() {
        let t = NumberedTable::new("incidents", "org", "number").unwrap();
        assert_eq!(t.name(), "public.incidents");
        assert_eq!(t.quoted(), "\"public\".\"incidents\"");
        assert_eq!(
            t.counter_key(),
            "\"public\".\"incidents\"(\"org\", \"number\")"
        );
        let t = NumberedTable::new("app.we\"ird", "org", "n").unwrap();
        assert_eq!(t.quoted(), "\"app\".\"we\"\"ird\"");
        for (table, scope, number) in [
            ("", "org", "n"),
            ("a.b.c", "org", "n"),
            ("t", "", "n"),
            ("t", "org", "org"),
            ("t", "o\0rg", "n"),
            ("t", &"x".repeat(64), "n"),
        ] {
            assert!(
                matches!(
                    NumberedTable::new(table, scope, number),
                    Err(Error::Invalid { .. })
                ),
                "{table:?} {scope:?} {number:?}"
            );
        }
    }

    #[test]
    fn statements_carry_the_quoted_names() {
        let seq = Sequence::new(
            NumberedTable::new("app.incidents", "org id", "no").unwrap(),
            SequenceConfig::default(),
        )
        .unwrap();
        assert!(seq.sql.take.contains(
            "sequence_take(E'advisory-lock', $1, E'app', E'incidents', E'org id', E'no', $2)"
        ));
        assert!(!seq.sql.counter.contains('{'));
        assert_eq!(literal(r"it's \x"), r"E'it''s \\x'");
    }

    #[test]
    fn names_that_look_like_placeholders_stay_names() {
        let seq = Sequence::new(
            NumberedTable::new(
                "{table_name}.||(select pg_sleep(5))::text||",
                "{scope}",
                "{number}",
            )
            .unwrap(),
            SequenceConfig::default(),
        )
        .unwrap();
        assert!(
            seq.sql.take.contains(
                "sequence_take(E'advisory-lock', $1, E'{table_name}', E'||(select pg_sleep(5))::text||', E'{scope}', E'{number}', $2)"
            ),
            "{}",
            seq.sql.take
        );
        assert!(
            seq.sql.counter.contains(
                "FROM \"{table_name}\".\"||(select pg_sleep(5))::text||\" WHERE \"{scope}\" = $3"
            ),
            "{}",
            seq.sql.counter
        );
        assert_eq!(fill("a {x} {y} {", &[("{x}", "{y}".into())]), "a {y} {y} {");
    }

    #[test]
    fn only_the_counter_row_accepts_snapshot_isolation() {
        for s in Strategy::ALL {
            assert!(s.accepts("read committed"));
            assert_eq!(s.accepts("repeatable read"), s == Strategy::CounterRow);
            assert_eq!(s.accepts("serializable"), s == Strategy::CounterRow);
        }
    }

    #[test]
    fn scopes_of_one_table_get_different_keys_and_tables_do_not_share_them() {
        let a = Sequence::new(
            NumberedTable::new("incidents", "org", "n").unwrap(),
            SequenceConfig::default(),
        )
        .unwrap();
        let b = Sequence::new(
            NumberedTable::new("public.tickets", "org", "n").unwrap(),
            SequenceConfig::default(),
        )
        .unwrap();
        assert_ne!(a.lock_key(&1i64).unwrap(), a.lock_key(&2i64).unwrap());
        assert_ne!(a.lock_key(&1i64).unwrap(), b.lock_key(&1i64).unwrap());
        assert_eq!(a.lock_key(&"1").unwrap(), a.lock_key(&1i64).unwrap());
    }
}
