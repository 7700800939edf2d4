//! The service's invariants, checked in the database after the fact: what
//! `pgonce demo` reports and the end-to-end tests assert.
//!
//! * I1: a singleton policy never has two OPEN incidents for one entity,
//!   checked over each incident's OPEN interval (opened until acknowledged
//!   or resolved), so a duplicate closed before the check still counts;
//! * I2: each organization's numbers are exactly 1..n;
//! * I3: each incident is notified exactly once: one `notifications` row,
//!   and one notification job, completed, unless maintenance has removed
//!   the finished job already (see [`not_notified_once`]);
//! * I6: every message sent to the pipeline was processed.
//!
//! The I3 check reads `pgonce.jobs` directly: an audit query, read-only,
//! over the columns the library's migration documents. Those rows do not
//! last: `pgonce::maintenance` deletes completed and dead jobs past their
//! retention, so the check relies on the `notifications` row for what is
//! gone and stays strict about every job row still there.

use serde::Serialize;
use sqlx::PgPool;

use crate::error::Result;

/// An incident that opened while another of its (policy, entity) was OPEN,
/// though the policy allowed one at a time for that entity then.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct DuplicateOpen {
    /// The singleton policy.
    pub policy_id: i64,
    /// The entity it had two OPEN incidents for.
    pub entity_id: i64,
    /// The incident that should not have opened.
    pub incident_id: i64,
    /// The (lowest id of the) incident that was OPEN when it did.
    pub while_open_id: i64,
    /// How many other incidents of the pair were OPEN at that moment.
    pub open_at_the_time: i64,
}

/// One organization whose numbers are not 1..n.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct NumberGap {
    /// The organization.
    pub organization_id: i64,
    /// How many incidents it has (n).
    pub count: i64,
    /// Its lowest number (1 when I2 holds).
    pub min: i64,
    /// Its highest number (`count` when I2 holds).
    pub max: i64,
    /// How many distinct numbers it has (`count` when I2 holds).
    pub distinct: i64,
}

/// One incident not notified exactly once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct NotNotifiedOnce {
    /// The incident.
    pub incident_id: i64,
    /// Its `notifications` rows (1 when I3 holds).
    pub notifications: i64,
    /// Its notification jobs still in `pgonce.jobs` (0 or 1 when I3 holds).
    pub jobs: i64,
    /// Those of its notification jobs that are completed (all of them when I3
    /// holds).
    pub completed_jobs: i64,
}

/// The outcome of every check. Each list is empty when its invariant holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct InvariantReport {
    /// I1's violations, over the whole database.
    pub i1_duplicate_open: Vec<DuplicateOpen>,
    /// I2's violations, over the whole database.
    pub i2_number_gaps: Vec<NumberGap>,
    /// I3's violations, for the organizations checked.
    pub i3_not_notified_once: Vec<NotNotifiedOnce>,
    /// Message ids sent but never processed.
    pub i6_unprocessed: Vec<String>,
}

impl InvariantReport {
    /// Whether I1 holds.
    pub fn i1(&self) -> bool {
        self.i1_duplicate_open.is_empty()
    }
    /// Whether I2 holds.
    pub fn i2(&self) -> bool {
        self.i2_number_gaps.is_empty()
    }
    /// Whether I3 holds.
    pub fn i3(&self) -> bool {
        self.i3_not_notified_once.is_empty()
    }
    /// Whether I6 holds.
    pub fn i6(&self) -> bool {
        self.i6_unprocessed.is_empty()
    }
    /// Whether I1, I2, I3 and I6 all hold.
    pub fn all_hold(&self) -> bool {
        self.i1() && self.i2() && self.i3() && self.i6()
    }
}

/// I1 over the whole database and its whole history: every incident that
/// opened while another of its singleton (policy, entity) was OPEN.
pub async fn duplicate_open(pool: &PgPool) -> Result<Vec<DuplicateOpen>> {
    Ok(
        sqlx::query_as(include_str!("invariants/sql/i1_singleton.sql"))
            .fetch_all(pool)
            .await?,
    )
}

/// I2 over the whole database.
pub async fn number_gaps(pool: &PgPool) -> Result<Vec<NumberGap>> {
    Ok(
        sqlx::query_as(include_str!("invariants/sql/i2_gapless.sql"))
            .fetch_all(pool)
            .await?,
    )
}

/// I3 for the incidents of `organizations`.
///
/// The notifier writes the `notifications` row in the transaction that
/// completes the job, so the row is the durable record of a delivery, and
/// the job row is one maintenance deletes some time after it completed (or
/// died). An incident holds I3 when it has its one `notifications` row and
/// either exactly one notification job, completed, or none left. Any job row
/// still present counts as it always did: a second job, or one not
/// completed beside a `notifications` row, is a violation; so is an
/// incident with no `notifications` row, whether its job is still there or
/// already removed.
pub async fn not_notified_once(
    pool: &PgPool,
    organizations: &[i64],
) -> Result<Vec<NotNotifiedOnce>> {
    let rows: Vec<NotNotifiedOnce> = sqlx::query_as(include_str!("invariants/sql/i3_notified.sql"))
        .bind(organizations)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().filter(|r| !r.holds()).collect())
}

impl NotNotifiedOnce {
    /// Whether these counts satisfy I3 (see [`not_notified_once`]).
    fn holds(&self) -> bool {
        let job_left_or_cleaned = matches!((self.jobs, self.completed_jobs), (1, 1) | (0, 0));
        self.notifications == 1 && job_left_or_cleaned
    }
}

/// I6: which of `sent` (queue message ids of observations sent without a
/// producer's id) the pipeline never finished.
pub async fn unprocessed(pool: &PgPool, sent: &[String]) -> Result<Vec<String>> {
    Ok(
        sqlx::query_scalar(include_str!("invariants/sql/i6_processed.sql"))
            .bind(sent)
            .fetch_all(pool)
            .await?,
    )
}

/// Every check, for `organizations` and the messages `sent`.
pub async fn check(
    pool: &PgPool,
    organizations: &[i64],
    sent: &[String],
) -> Result<InvariantReport> {
    Ok(InvariantReport {
        i1_duplicate_open: duplicate_open(pool).await?,
        i2_number_gaps: number_gaps(pool).await?,
        i3_not_notified_once: not_notified_once(pool, organizations).await?,
        i6_unprocessed: unprocessed(pool, sent).await?,
    })
}

/// Totals for a report over `organizations`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Tallies {
    /// Incidents, in any lifecycle state.
    pub incidents: i64,
    /// Incidents still OPEN.
    pub open: i64,
    /// `notifications` rows: notifications delivered.
    pub notifications: i64,
    /// Deliveries the pipeline finished (first and repeated).
    pub deliveries_processed: i64,
    /// Distinct messages the pipeline finished, one per entity: a producer
    /// message id carried by observations of several entities counts once
    /// for each.
    pub messages_processed: i64,
    /// Incidents a policy opened more than once for one entity from one
    /// message (the redelivery duplicates the guard prevents); a producer
    /// message id carried by observations of several entities opens one
    /// incident per entity, none of them a duplicate.
    pub opened_twice_for_one_message: i64,
    /// Incidents declared by hand (no policy).
    pub declared: i64,
}

/// The [`Tallies`] of `organizations`, read in one statement.
pub async fn tallies(pool: &PgPool, organizations: &[i64]) -> Result<Tallies> {
    Ok(sqlx::query_as(include_str!("invariants/sql/tallies.sql"))
        .bind(organizations)
        .fetch_one(pool)
        .await?)
}
