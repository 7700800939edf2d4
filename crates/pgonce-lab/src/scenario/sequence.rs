//! The sequence scenario (I2, per-scope gapless numbers): a declaration does
//! its other work and writes one row carrying the scope's next number, taken
//! under one of pgonce's [`Sequence`] strategies, in one READ COMMITTED
//! transaction. Everything that touches its rows is here: the tables, the
//! sequence over them, taking a number, the numbered insert (early, the
//! number first and the scope locked until the transaction ends; or late,
//! through [`Sequence::commit_numbered`]) with its typed outcome, and the
//! per-scope check of what was committed. `pgonce race sequence` replays it
//! step by step, `pgonce bench sequence` measures it under load, and
//! `pgonce chaos --scenario sequence` runs it under faults.
//!
//! One table serves every strategy and every run: rows are kept apart by
//! their scope, and so are the strategies' locks (an advisory lock and a
//! counter row per (table, scope)), except the table lock's, which blocks
//! every write to the table, as it would to `incidents`.
//!
//! A declaration whose number another declaration of its scope had already
//! computed is turned away by the unique index ([`Declared::NumberTaken`]),
//! and one aborted by a deadlock or a serialization failure is retryable
//! ([`Declared::Aborted`]): outcomes of a strategy callers count, rather
//! than an `Err` they must pick apart.

use pgonce::{
    Error, IsolationLevel, Numbered, NumberedTable, Sequence, SequenceConfig,
    SequenceStrategy as Strategy, Taken,
};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

/// The numbered table, as the sequence (and its counter rows) name it.
pub(crate) const TABLE: &str = "public.sequence_incident";

/// Creates the scenario's tables if they are missing (every driver calls
/// it; rows of different runs are kept apart by their scope).
pub(crate) async fn create_schema(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql(include_str!("sql/sequence_schema.sql"))
        .execute(pool)
        .await
        .map(|_| ())
}

/// Empties the tables and the table's counter rows, for a driver that owns
/// its database and wants each measurement to start from the same size.
pub(crate) async fn reset(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql(include_str!("sql/sequence_reset.sql"))
        .execute(pool)
        .await
        .map(|_| ())
}

/// The sequence that numbers the table under `strategy`.
pub(crate) fn sequence(strategy: Strategy) -> pgonce::Result<Sequence> {
    Sequence::new(
        NumberedTable::new(TABLE, "scope", "number")?,
        SequenceConfig { strategy },
    )
}

/// A declaration transaction: READ COMMITTED, which the max + 1 strategies
/// need.
pub(crate) async fn begin(pool: &PgPool) -> sqlx::Result<Transaction<'static, Postgres>> {
    pgonce::begin(pool, IsolationLevel::ReadCommitted).await
}

/// Takes `scope`'s next number in `tx` under the sequence's strategy; the
/// scope stays locked until `tx` ends.
pub(crate) async fn take(
    seq: &Sequence,
    tx: &mut Transaction<'_, Postgres>,
    scope: &str,
) -> pgonce::Result<Taken> {
    seq.next(tx, &scope).await
}

/// Inserts the row carrying `number`, tagged with `op`.
pub(crate) async fn insert(
    conn: &mut PgConnection,
    scope: &str,
    number: i64,
    op: i64,
) -> pgonce::Result<()> {
    sqlx::query(include_str!("sql/sequence_insert.sql"))
        .bind(scope)
        .bind(number)
        .bind(op)
        .execute(conn)
        .await?;
    Ok(())
}

/// One write of the declaration's other work.
pub(crate) async fn other_work(
    conn: &mut PgConnection,
    scope: &str,
    what: &str,
) -> pgonce::Result<()> {
    sqlx::query(include_str!("sql/sequence_work.sql"))
        .bind(scope)
        .bind(what)
        .execute(conn)
        .await?;
    Ok(())
}

/// What a numbered insert came to.
#[derive(Debug)]
pub(crate) enum Declared<T> {
    /// The row was written with its number: [`Taken`] when numbered early
    /// (not yet committed), [`Numbered`] once committed late.
    Numbered(T),
    /// The unique index turned the row away: another declaration of the
    /// scope had computed the same number ([`Error::NumberTaken`]). The
    /// transaction is aborted; nothing of it is kept.
    NumberTaken(Error),
    /// A deadlock or a serialization failure aborted the declaration: no
    /// number was used, and it may be retried.
    Aborted(Error),
}

impl<T> Declared<T> {
    fn of(result: pgonce::Result<T>) -> pgonce::Result<Declared<T>> {
        match result {
            Ok(numbered) => Ok(Declared::Numbered(numbered)),
            Err(e @ Error::NumberTaken { .. }) => Ok(Declared::NumberTaken(e)),
            Err(e) if e.is_retryable() => Ok(Declared::Aborted(e)),
            Err(e) => Err(e),
        }
    }

    /// The same outcome with the numbered value mapped.
    pub(crate) fn map<U>(self, f: impl FnOnce(T) -> U) -> Declared<U> {
        match self {
            Declared::Numbered(numbered) => Declared::Numbered(f(numbered)),
            Declared::NumberTaken(e) => Declared::NumberTaken(e),
            Declared::Aborted(e) => Declared::Aborted(e),
        }
    }

    /// The numbered value, or the refusal, for a declaration that goes on
    /// after its number and ends with an outcome of its own.
    pub(crate) fn numbered<U>(self) -> Result<T, Declared<U>> {
        match self {
            Declared::Numbered(numbered) => Ok(numbered),
            Declared::NumberTaken(e) => Err(Declared::NumberTaken(e)),
            Declared::Aborted(e) => Err(Declared::Aborted(e)),
        }
    }

    /// The numbered value, or the error that refused it: for a caller that
    /// records results as they are.
    pub(crate) fn into_result(self) -> pgonce::Result<T> {
        match self {
            Declared::Numbered(numbered) => Ok(numbered),
            Declared::NumberTaken(e) | Declared::Aborted(e) => Err(e),
        }
    }
}

/// Numbers early: takes `scope`'s next number in `tx` and inserts the row
/// carrying it. The scope stays locked for the rest of `tx`.
pub(crate) async fn number(
    seq: &Sequence,
    tx: &mut Transaction<'_, Postgres>,
    scope: &str,
    op: i64,
) -> pgonce::Result<Declared<Taken>> {
    let numbered = async {
        let taken = take(seq, tx, scope).await?;
        insert(tx, scope, taken.number, op)
            .await
            .map_err(|e| seq.number_taken(e, &scope, taken.number))?;
        Ok(taken)
    };
    Declared::of(numbered.await)
}

/// Numbers late: hands `tx`, its other work done, to
/// [`Sequence::commit_numbered`], which takes the number, inserts the row
/// and commits; the scope is locked only from the number to the COMMIT. On
/// any error `tx` is rolled back.
pub(crate) async fn commit_numbered(
    seq: &Sequence,
    tx: Transaction<'static, Postgres>,
    scope: &str,
    op: i64,
) -> pgonce::Result<Declared<Numbered<()>>> {
    let numbered = seq
        .commit_numbered(tx, &scope, async |conn: &mut PgConnection, n| {
            insert(conn, scope, n, op).await
        })
        .await;
    Declared::of(numbered)
}

/// One scope's committed numbers, in order, and the operation that wrote
/// each.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct ScopeNumbers {
    pub(crate) scope: String,
    pub(crate) numbers: Vec<i64>,
    pub(crate) ops: Vec<i64>,
}

impl ScopeNumbers {
    /// Numbers stored more than once (the unique index keeps this at 0).
    pub(crate) fn duplicates(&self) -> i64 {
        let mut distinct = self.numbers.clone();
        distinct.dedup();
        (self.numbers.len() - distinct.len()) as i64
    }

    /// Numbers out of place: those missing from 1 up to the scope's
    /// highest, and those stored below 1 (numbers start at 1). Never
    /// negative, so a sum over scopes counts every one: a number below 1
    /// does not offset a gap elsewhere. A number missing above the highest
    /// stored is not seen here; [`unaccounted`] sets the table against what
    /// the declarations were told.
    pub(crate) fn gaps(&self) -> i64 {
        let mut distinct = self.numbers.clone();
        distinct.dedup();
        let below_one = distinct.iter().filter(|n| **n < 1).count() as i64;
        let from_one = distinct.len() as i64 - below_one;
        let highest = distinct.last().copied().unwrap_or(0).max(0);
        highest - from_one + below_one
    }

    /// I2 for the scope: its numbers are exactly 1..=n.
    pub(crate) fn held(&self) -> bool {
        self.duplicates() == 0 && self.gaps() == 0
    }
}

/// A declaration its driver saw commit, with the number it was told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CommittedDeclaration {
    /// The scope it declared in.
    pub(crate) scope: String,
    /// The operation its row is tagged with.
    pub(crate) op: i64,
    /// The number the sequence told it.
    pub(crate) number: i64,
}

/// What the declarations were told against what the table holds, each
/// difference said in words: a declaration told a number its row does not
/// carry (or whose row is missing), and a row no committed declaration was
/// told. [`ScopeNumbers::gaps`] cannot see a number missing above the
/// highest stored, nor a row carrying another number than its declaration
/// was told; this sees both.
pub(crate) fn unaccounted(
    declared: &[CommittedDeclaration],
    stored: &[ScopeNumbers],
) -> Vec<String> {
    let mut rows: Vec<(&str, i64, i64)> = stored
        .iter()
        .flat_map(|s| {
            s.numbers
                .iter()
                .zip(&s.ops)
                .map(|(number, op)| (s.scope.as_str(), *number, *op))
        })
        .collect();
    let mut found = Vec::new();
    for d in declared {
        match rows
            .iter()
            .position(|(scope, number, op)| *scope == d.scope && *number == d.number && *op == d.op)
        {
            Some(at) => {
                rows.swap_remove(at);
            }
            None => found.push(format!(
                "op {} was told {} in {}, and no such row is committed",
                d.op, d.number, d.scope
            )),
        }
    }
    found.extend(rows.into_iter().map(|(scope, number, op)| {
        format!(
            "{number} is committed in {scope} by op {op}, which no committed declaration was told"
        )
    }));
    found
}

/// The committed numbers of each of `scopes` that has any, by scope.
pub(crate) async fn numbers(pool: &PgPool, scopes: &[String]) -> sqlx::Result<Vec<ScopeNumbers>> {
    sqlx::query_as(include_str!("sql/sequence_numbers.sql"))
        .bind(scopes)
        .fetch_all(pool)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(numbers: &[i64]) -> ScopeNumbers {
        ScopeNumbers {
            scope: "s".to_owned(),
            numbers: numbers.to_vec(),
            ops: (1..=numbers.len() as i64).collect(),
        }
    }

    fn told(op: i64, number: i64) -> CommittedDeclaration {
        CommittedDeclaration {
            scope: "s".to_owned(),
            op,
            number,
        }
    }

    #[test]
    fn a_number_told_above_the_highest_stored_is_unaccounted_though_no_gap_shows() {
        // Declarations 1 and 2 committed with numbers 1 and 2; only 1's row
        // is there. The table alone looks gapless.
        let table = stored(&[1]);
        assert!(table.held());
        let found = unaccounted(&[told(1, 1), told(2, 2)], std::slice::from_ref(&table));
        assert_eq!(
            found,
            ["op 2 was told 2 in s, and no such row is committed"]
        );
    }

    #[test]
    fn a_row_with_another_number_or_nobody_told_is_unaccounted() {
        // Op 2 was told 3, its row carries 2: both sides are reported.
        let table = stored(&[1, 2]);
        let found = unaccounted(&[told(1, 1), told(2, 3)], std::slice::from_ref(&table));
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[1].contains("2 is committed in s by op 2"),
            "{found:?}"
        );
        // Every told number has its row, and nothing else is stored.
        assert!(unaccounted(&[told(2, 2), told(1, 1)], &[table]).is_empty());
        assert!(unaccounted(&[], &[]).is_empty());
    }

    #[test]
    fn a_number_below_one_is_out_of_place_and_offsets_no_gap_elsewhere() {
        let from_zero = stored(&[0, 1, 2]);
        let with_gap = stored(&[1, 3]);
        assert_eq!((from_zero.gaps(), with_gap.gaps()), (1, 1));
        assert_eq!(stored(&[-2, -1]).gaps(), 2);
        assert!(!from_zero.held() && !with_gap.held());
        assert!(stored(&[1, 2, 3]).held() && stored(&[]).held());
        assert_eq!(stored(&[1, 2, 2]).duplicates(), 1);
    }
}
