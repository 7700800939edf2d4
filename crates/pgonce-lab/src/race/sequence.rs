//! `pgonce race sequence`: concurrent incident declarations, step by step,
//! under each sequence strategy. A takes acme's next number and holds it; B
//! declares in acme, C in globex; A commits; then D takes a number in acme
//! and rolls back, and declares again. The table says, per strategy, which
//! numbers were committed, whether any was duplicated or skipped, whether
//! the rolled-back number was handed out again, and who waited for whom.
//!
//! The declarations are the sequence scenario's
//! (`scenario::sequence`). Each strategy numbers its own scopes of
//! the scenario's one table, so each starts from empty scopes and counter
//! rows; the table lock still makes C wait, since it blocks every write to
//! the table, whatever the scope.

use std::collections::BTreeMap;

use anyhow::Context;
use pgonce::IsolationLevel;
use pgonce::{Error, Sequence, SequenceStrategy as Strategy};
use pgonce_testkit::Interleaving;
use sqlx::PgPool;

use super::{maybe_blocks, timeline_rows};
use crate::report::{Environment, Report, Row};
use crate::scenario::sequence::{self as scenario, CommittedDeclaration, Declared};
use crate::scratch::RunDatabase;

/// Everything `pgonce race sequence` replays.
#[derive(Debug, Clone)]
pub struct SequenceRace {
    /// One case per sequence strategy.
    pub cases: Vec<SequenceCase>,
    /// Each strategy's `next` in a REPEATABLE READ transaction.
    pub under_repeatable_read: Vec<IsolationOutcome>,
}

/// What a strategy's `next` did in a REPEATABLE READ transaction.
#[derive(Debug, Clone, Copy)]
pub struct IsolationOutcome {
    /// The sequence strategy.
    pub strategy: Strategy,
    /// Refused with `WrongIsolation` (true) or accepted.
    pub refused: bool,
}

pub(crate) async fn run(db: &RunDatabase) -> anyhow::Result<Report> {
    let race = replay(db).await?;
    Ok(report(&race, db.environment().await?))
}

/// Replays the declarations on `db` under each sequence strategy, and
/// tries each strategy's `next` under REPEATABLE READ.
pub async fn replay(db: &RunDatabase) -> anyhow::Result<SequenceRace> {
    scenario::create_schema(db.pool()).await?;
    let mut cases = Vec::new();
    for strategy in Strategy::ALL {
        cases.push(
            replay_case(db, strategy)
                .await
                .with_context(|| format!("replaying under {strategy}"))?,
        );
    }
    Ok(SequenceRace {
        cases,
        under_repeatable_read: wrong_isolation(db).await?,
    })
}

pub(crate) fn report(race: &SequenceRace, environment: Environment) -> Report {
    let mut report = Report::new("race", "sequence", environment);
    for case in &race.cases {
        let strategy = case.strategy;
        judge(&mut report, strategy, case);
        report.results.push(case.row(strategy));
        report.sections.insert(
            format!("timeline: {strategy}"),
            timeline_rows(strategy.name(), &case.timeline),
        );
    }
    let isolation = &race.under_repeatable_read;
    report.verdict.check(
        isolation
            .iter()
            .all(|o| o.refused != o.strategy.accepts("repeatable read")),
        "under REPEATABLE READ the max + 1 strategies refuse with a typed WrongIsolation error (no number, no lock); the counter row accepts",
    );
    report.sections.insert(
        "isolation: next() under REPEATABLE READ".into(),
        isolation
            .iter()
            .map(|o| {
                Row::new(o.strategy.name()).with(
                    "outcome",
                    if o.refused {
                        "Error::WrongIsolation (needs read committed)"
                    } else {
                        "accepted (a concurrent update aborts with 40001, never a duplicate)"
                    },
                )
            })
            .collect(),
    );
    report
}

/// What one strategy's replay showed.
#[derive(Debug, Clone)]
pub struct SequenceCase {
    /// The sequence strategy the declarations used.
    pub strategy: Strategy,
    /// Committed numbers per organization, read from the table.
    pub committed: BTreeMap<String, Vec<i64>>,
    /// Numbers committed more than once in an organization, all told.
    pub duplicates: i64,
    /// Numbers missing below an organization's highest, all told.
    pub gaps: i64,
    /// Where what the declarations were told and what the table holds
    /// differ, in words: a number told whose row is missing or carries
    /// another number, a row nobody was told. Empty when they agree.
    pub unaccounted: Vec<String>,
    /// B's declaration in A's organization: its number, or why it failed.
    pub b: Result<i64, String>,
    /// Whom B was seen waiting for.
    pub b_waited_for: Vec<String>,
    /// C declares in another organization.
    pub c_waited_for: Vec<String>,
    /// The number D took and rolled back.
    pub rolled_back: i64,
    /// The number D got when it declared again: the same one, if numbers
    /// stay gapless.
    pub after_rollback: i64,
    pub(crate) timeline: Vec<pgonce_testkit::Step>,
}

impl SequenceCase {
    /// Whether C, declaring in another organization, waited.
    pub fn other_scope_waited(&self) -> bool {
        !self.c_waited_for.is_empty()
    }

    /// Declarations that failed: B's, if it did.
    pub fn failed_declarations(&self) -> usize {
        usize::from(self.b.is_err())
    }

    /// I2: unique and gapless, every declaration got its number, and one
    /// scope never waited for another.
    pub fn invariant_held(&self) -> bool {
        self.duplicates == 0
            && self.gaps == 0
            && self.unaccounted.is_empty()
            && self.failed_declarations() == 0
            && self.after_rollback == self.rolled_back
            && !self.other_scope_waited()
    }

    fn row(&self, strategy: Strategy) -> Row {
        let numbers = self
            .committed
            .iter()
            .map(|(org, ns)| {
                let ns: Vec<String> = ns.iter().map(i64::to_string).collect();
                format!("{org}: {}", ns.join(","))
            })
            .collect::<Vec<_>>()
            .join("; ");
        let waited = |who: &str, by: &[String]| {
            if by.is_empty() {
                format!("{who}: no wait")
            } else {
                format!("{who} waited for {}", by.join(", "))
            }
        };
        Row::new(strategy.name())
            .with("numbers_committed", numbers)
            .with(
                "b_same_scope",
                match &self.b {
                    Ok(n) => format!("got {n}"),
                    Err(e) => e.clone(),
                },
            )
            .with("same_scope", waited("B", &self.b_waited_for))
            .with("other_scope", waited("C", &self.c_waited_for))
            .with("duplicates", self.duplicates)
            .with("gaps", self.gaps)
            .with(
                "told_vs_committed",
                if self.unaccounted.is_empty() {
                    "agree".to_owned()
                } else {
                    self.unaccounted.join("; ")
                },
            )
            .with("failed_declarations", self.failed_declarations())
            .with(
                "rollback_number_reused",
                self.after_rollback == self.rolled_back,
            )
            .with("invariant_held", self.invariant_held())
    }
}

/// The verdict: the default keeps I2, and each row says what its strategy
/// is known to do.
fn judge(report: &mut Report, strategy: Strategy, o: &SequenceCase) {
    let name = strategy.name();
    report.verdict.check(
        o.duplicates == 0,
        format!("{name}: no duplicate committed (the unique index backs every strategy)"),
    );
    report.verdict.check(
        o.unaccounted.is_empty(),
        if o.unaccounted.is_empty() {
            format!("{name}: every committed declaration's row carries the number it was told, and no other row is committed")
        } else {
            format!("{name}: {}", o.unaccounted.join("; "))
        },
    );
    report.verdict.check(
        o.after_rollback == o.rolled_back,
        format!(
            "{name}: the rolled-back number {} was handed out again",
            o.rolled_back
        ),
    );
    match strategy {
        Strategy::AdvisoryLock | Strategy::CounterRow => report.verdict.check(
            o.invariant_held() && o.b_waited_for == ["A"],
            format!("{name}: I2 held; B waited for A only, C did not wait"),
        ),
        Strategy::TableLock => report.verdict.check(
            o.other_scope_waited() && o.gaps == 0 && o.failed_declarations() == 0,
            format!(
                "{name}: gapless, but C (globex) waited for {} (shown, as expected)",
                o.c_waited_for.join(", ")
            ),
        ),
        Strategy::SelectForUpdate => report.verdict.check(
            o.failed_declarations() == 1 && !o.other_scope_waited(),
            format!(
                "{name}: in an empty scope B locked nothing, computed A's number, its INSERT waited on A's index entry and was rejected by the unique index (shown, as expected)"
            ),
        ),
        _ => report
            .verdict
            .check(false, format!("{name}: no expectation written")),
    }
}

/// The organizations of the replay.
const ORGS: [&str; 2] = ["acme", "globex"];

/// The op each session tags its rows with.
const OP_A: i64 = 1;
const OP_B: i64 = 2;
const OP_C: i64 = 3;
const OP_D: i64 = 4;

/// `org`'s scope under `strategy`: each strategy numbers its own.
fn scope(strategy: Strategy, org: &str) -> String {
    format!("race/{strategy}/{org}")
}

/// A declaration as an incident service does it: some other work, then the
/// number, in one transaction.
async fn declare(seq: Sequence, pool: PgPool, scope: String, op: i64) -> Result<i64, String> {
    let outcome = async {
        let mut tx = scenario::begin(&pool).await?;
        scenario::other_work(&mut tx, &scope, "paged on-call").await?;
        scenario::commit_numbered(&seq, tx, &scope, op).await
    };
    match outcome.await {
        Ok(Declared::Numbered(done)) => Ok(done.number),
        Ok(Declared::NumberTaken(Error::NumberTaken { number, .. })) => {
            Err(format!("NumberTaken({number})"))
        }
        Ok(Declared::NumberTaken(e) | Declared::Aborted(e)) | Err(e) => Err(e.to_string()),
    }
}

async fn replay_case(db: &RunDatabase, strategy: Strategy) -> anyhow::Result<SequenceCase> {
    let seq = scenario::sequence(strategy)?;
    let [acme, globex] = ORGS.map(|org| scope(strategy, org));
    let race = Interleaving::new(db.options()).await?;
    let a = race.session("A").await?;
    let b = race.session("B").await?;
    let c = race.session("C").await?;
    let d = race.session("D").await?;

    let mut tx_a = race
        .try_step(&a, "BEGIN", scenario::begin(a.pool()))
        .await?;
    let taken = race
        .try_step(&a, "next(acme)", scenario::take(&seq, &mut tx_a, &acme))
        .await?;
    race.try_step(
        &a,
        &format!("INSERT acme #{}", taken.number),
        scenario::insert(&mut tx_a, &acme, taken.number, OP_A),
    )
    .await?;

    let b_step = maybe_blocks(
        &race,
        &b,
        "declare(acme)",
        declare(seq.clone(), b.pool().clone(), acme.clone(), OP_B),
    )
    .await?;
    let c_step = maybe_blocks(
        &race,
        &c,
        "declare(globex)",
        declare(seq.clone(), c.pool().clone(), globex.clone(), OP_C),
    )
    .await?;
    race.try_step(&a, "COMMIT", tx_a.commit()).await?;
    let (b_waited_for, b_out) = (b_step.waited_for.clone(), b_step.finish().await?);
    race.note(&b, &format!("declare(acme): {}", show(&b_out)));
    let (c_waited_for, c_out) = (c_step.waited_for.clone(), c_step.finish().await?);
    race.note(&c, &format!("declare(globex): {}", show(&c_out)));

    // A declaration that fails late: its number must be free again.
    let mut tx_d = race
        .try_step(&d, "BEGIN", scenario::begin(d.pool()))
        .await?;
    let rolled_back = race
        .try_step(&d, "next(acme)", scenario::take(&seq, &mut tx_d, &acme))
        .await?
        .number;
    race.try_step(
        &d,
        &format!("INSERT acme #{rolled_back}"),
        scenario::insert(&mut tx_d, &acme, rolled_back, OP_D),
    )
    .await?;
    race.try_step(&d, "ROLLBACK", tx_d.rollback()).await?;
    let after_rollback = race
        .step(
            &d,
            "declare(acme)",
            declare(seq.clone(), d.pool().clone(), acme.clone(), OP_D),
        )
        .await?
        .map_err(anyhow::Error::msg)?;
    race.note(&d, &format!("declare(acme): got {after_rollback}"));

    let mut told = vec![
        told_number(&acme, OP_A, taken.number),
        told_number(&acme, OP_D, after_rollback),
    ];
    told.extend(b_out.as_ref().ok().map(|n| told_number(&acme, OP_B, *n)));
    told.extend(c_out.as_ref().ok().map(|n| told_number(&globex, OP_C, *n)));
    let stored = check(db.pool(), strategy, &told).await?;
    Ok(SequenceCase {
        strategy,
        committed: stored.committed,
        duplicates: stored.duplicates,
        gaps: stored.gaps,
        unaccounted: stored.unaccounted,
        b: b_out,
        b_waited_for,
        c_waited_for,
        rolled_back,
        after_rollback,
        timeline: race.timeline(),
    })
}

fn show(out: &Result<i64, String>) -> String {
    match out {
        Ok(n) => format!("got {n}"),
        Err(e) => format!("failed: {e}"),
    }
}

fn told_number(scope: &str, op: i64, number: i64) -> CommittedDeclaration {
    CommittedDeclaration {
        scope: scope.to_owned(),
        op,
        number,
    }
}

/// What one strategy's scopes hold once the replay is over.
struct Stored {
    /// Committed numbers per organization.
    committed: BTreeMap<String, Vec<i64>>,
    duplicates: i64,
    gaps: i64,
    /// Differences from what the committed declarations were told.
    unaccounted: Vec<String>,
}

/// Reads the strategy's scopes as the scenario's per-scope check does, and
/// sets them against the numbers the committed declarations were `told`.
async fn check(
    pool: &PgPool,
    strategy: Strategy,
    told: &[CommittedDeclaration],
) -> anyhow::Result<Stored> {
    let scopes = ORGS.map(|org| scope(strategy, org));
    let rows = scenario::numbers(pool, &scopes).await?;
    let mut stored = Stored {
        committed: BTreeMap::new(),
        duplicates: 0,
        gaps: 0,
        unaccounted: scenario::unaccounted(told, &rows),
    };
    for (org, scope) in ORGS.iter().zip(&scopes) {
        if let Some(row) = rows.iter().find(|r| &r.scope == scope) {
            stored.duplicates += row.duplicates();
            stored.gaps += row.gaps();
            stored
                .committed
                .insert(org.to_string(), row.numbers.clone());
        }
    }
    Ok(stored)
}

/// Each strategy's `next` in a REPEATABLE READ transaction: refused or not.
async fn wrong_isolation(db: &RunDatabase) -> anyhow::Result<Vec<IsolationOutcome>> {
    let mut out = Vec::new();
    for strategy in Strategy::ALL {
        let seq = scenario::sequence(strategy)?;
        let mut tx = pgonce::begin(db.pool(), IsolationLevel::RepeatableRead).await?;
        let refused = match scenario::take(&seq, &mut tx, &scope(strategy, "initech")).await {
            Err(Error::WrongIsolation { .. }) => true,
            Ok(_) => false,
            Err(e) => return Err(e.into()),
        };
        tx.rollback().await?;
        out.push(IsolationOutcome { strategy, refused });
    }
    Ok(out)
}
