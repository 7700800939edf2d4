//! The races `pgonce race` replays, asserted on their typed outcomes: each
//! interleaving is written once, in the lab, and these tests say what it
//! must show.

use pgonce::SequenceStrategy;
use pgonce::events::AppendStrategy;
use pgonce::job::JobStatus;
use pgonce_lab::race::events::{self, AppendOutcome};
use pgonce_lab::race::events_late_writer::{self, LateWriter};
use pgonce_lab::race::jobs::{self, Delivery, JobCaseName};
use pgonce_lab::race::{guard, lock_wait, sequence};
use pgonce_lab::scenario::guard::GuardStrategy;
use pgonce_lab::scratch::RunDatabase;
use serde_json::json;

/// The DCB event store's three writers (A and C on booking:123, B on
/// booking:456), all decided "no booking yet" before anyone appended.
/// Advisory locks: A and B in parallel, C waits for A only and fails its
/// condition. Table lock: B and C wait for A; C fails. SSI: nobody waits; C
/// fails at commit and, retried, fails its condition. Under every strategy
/// the log ends with one booking per tag.
#[tokio::test]
async fn events_three_writers_under_each_strategy() -> anyhow::Result<()> {
    let db = RunDatabase::for_tests("races").await?;
    let race = events::replay(&db).await?;
    assert_eq!(race.three_writers.len(), AppendStrategy::ALL.len());
    for case in &race.three_writers {
        let s = case.strategy;
        assert_eq!(case.bookings("booking:123"), 1, "{s:?}: {:?}", case.log);
        assert_eq!(case.bookings("booking:456"), 1, "{s:?}: {:?}", case.log);
        assert!(case.invariant_held(), "{s:?}");
        match s {
            AppendStrategy::AdvisoryLocks => {
                assert_eq!(case.parallel, ["A", "B"]);
                assert_eq!(case.waited_for("B"), None, "another tag does not wait");
                assert_eq!(case.waited_for("C"), Some(&["A".to_string()][..]));
                assert!(case.b.committed(), "{:?}", case.b);
                assert!(
                    matches!(case.c, AppendOutcome::ConditionFailed { .. }),
                    "C sees A's booking: {:?}",
                    case.c
                );
            }
            AppendStrategy::TableLock => {
                assert_eq!(
                    case.waited_for("B"),
                    Some(&["A".to_string()][..]),
                    "even a different tag waits"
                );
                assert!(
                    case.waited_for("C")
                        .is_some_and(|by| by.contains(&"A".into()))
                );
                assert!(case.b.committed(), "B appends after A: {:?}", case.b);
                assert!(
                    matches!(case.c, AppendOutcome::ConditionFailed { .. }),
                    "{:?}",
                    case.c
                );
            }
            AppendStrategy::Serializable => {
                assert!(case.waits.is_empty(), "nobody waits: {:?}", case.waits);
                assert_eq!(case.parallel, ["A", "B", "C"]);
                // B may hit a false positive of page-level predicate locks
                // on a tiny table; its retry goes through.
                assert!(
                    case.b.committed()
                        || case.b_retry.as_ref().is_some_and(AppendOutcome::committed),
                    "{:?} {:?}",
                    case.b,
                    case.b_retry
                );
                assert!(
                    case.c.is_serialization_failure(),
                    "C fails at commit: {:?}",
                    case.c
                );
                assert!(
                    matches!(case.c_retry, Some(AppendOutcome::ConditionFailed { .. })),
                    "retried, C sees A: {:?}",
                    case.c_retry
                );
            }
        }
    }
    db.close().await
}

/// Out-of-order commits: W1 draws position 1 (booking:9) but commits after
/// W2 committed position 2. A plain read in between misses 1 (the hazard);
/// a decision read waits for W1 (blocked on its key), sees 1, and its
/// `after` is safe: a stale condition fails, the decision's own holds. The
/// catch-up reader delivers nothing until 1 commits, then 1 and 2 in order;
/// a rolled-back 3 stops it only until its transaction has ended.
#[tokio::test]
async fn events_out_of_order_commits_hide_nothing() -> anyhow::Result<()> {
    let db = RunDatabase::for_tests("races").await?;
    let race = events::replay(&db).await?;
    for case in &race.late_decisions {
        let s = case.strategy;
        assert!(
            case.plain_read_saw.is_empty(),
            "{s:?}: 1 is not visible yet"
        );
        assert_eq!(case.r_waited_for, ["W1"], "{s:?}");
        assert_eq!(
            case.decision_saw,
            [1],
            "{s:?}: the decision saw the late commit"
        );
        assert!(
            matches!(case.stale, AppendOutcome::ConditionFailed { .. }),
            "{s:?}: {:?}",
            case.stale
        );
        assert!(case.fresh.committed(), "{s:?}: {:?}", case.fresh);
        assert!(case.invariant_held());
    }
    let c = &race.catch_up;
    assert!(
        c.first_poll.is_empty() && c.first_poll_waiting_on_gap,
        "{c:?}"
    );
    assert_eq!(c.second_poll, [1, 2], "in order, none skipped");
    assert!(c.third_poll.is_empty(), "3 is in flight");
    assert_eq!(
        c.after_rollback,
        [4],
        "the rolled-back 3 is a permanent gap"
    );
    db.close().await
}

/// A writer without a condition (A, `course:1` at position 2) is open while
/// C, which decided `after` = 1, checks "no course:1 after 1". Under the
/// table lock and the advisory locks C waits for A, sees its event, and
/// fails its condition; nothing commits over A's lower event.
#[tokio::test]
async fn events_late_writer_blocks_c_under_the_lock_strategies() -> anyhow::Result<()> {
    let db = RunDatabase::for_tests("races").await?;
    for writer in LateWriter::ALL {
        for strategy in [AppendStrategy::TableLock, AppendStrategy::AdvisoryLocks] {
            let case = events_late_writer::replay_case(&db, strategy, writer).await?;
            let what = format!("{strategy:?}, {writer:?}");
            assert_eq!(case.after, Some(1), "{what}");
            assert_eq!(case.a_drew, [2], "{what}");
            assert!(case.a.committed(), "{what}: {:?}", case.a);
            assert!(case.b.committed(), "{what}: {:?}", case.b);
            assert!(
                case.c_waited_for.contains(&"A".to_string()),
                "{what}: C waits for A: {:?}",
                case.c_waited_for
            );
            assert_eq!(
                case.c,
                AppendOutcome::ConditionFailed { matching: vec![2] },
                "{what}"
            );
            assert!(case.violations().is_empty(), "{what}");
        }
    }
    db.close().await
}

/// The same schedule under SERIALIZABLE: C does not wait, so PostgreSQL
/// must refuse one of the two (C fails its condition, or C or A gets a
/// serialization failure); both committing is a violation.
#[tokio::test]
async fn events_late_writer_never_lets_c_commit_under_serializable() -> anyhow::Result<()> {
    let db = RunDatabase::for_tests("races").await?;
    for writer in LateWriter::ALL {
        let case =
            events_late_writer::replay_case(&db, AppendStrategy::Serializable, writer).await?;
        assert!(
            !(case.a.committed() && case.c.committed()),
            "{writer:?}: A {:?} and C {:?} both committed",
            case.a,
            case.c
        );
        assert_eq!(
            case.violations(),
            Vec::<i64>::new(),
            "{writer:?}: log {:?}",
            case.log
        );
    }
    db.close().await
}

/// The property every guard rests on: a transaction-level advisory lock
/// taken inside a transaction makes B wait until A commits; in autocommit
/// it is gone when its statement ends, and B does not wait.
#[tokio::test]
async fn lock_wait_holds_only_inside_a_transaction() -> anyhow::Result<()> {
    let db = RunDatabase::for_tests("races").await?;
    let race = lock_wait::replay(&db).await?;
    assert!(race.inside_transaction.b_waited_for_a);
    assert!(!race.outside_transaction.b_waited_for_a);
    db.close().await
}

/// Concurrent incident declarations: A holds acme's next number; B declares in
/// acme, C in globex; A commits; D takes a number, rolls back, declares
/// again. Under the advisory lock and the counter row numbers are unique
/// and gapless, B waits for A only and C for nobody; the table lock makes C
/// wait; FOR UPDATE in an empty scope fails B's declaration. Under every
/// strategy no duplicate commits and the rolled-back number is reused.
#[tokio::test]
async fn sequence_declarations_under_each_strategy() -> anyhow::Result<()> {
    let db = RunDatabase::for_tests("races").await?;
    let race = sequence::replay(&db).await?;
    assert_eq!(race.cases.len(), SequenceStrategy::ALL.len());
    for case in &race.cases {
        let s = case.strategy;
        assert_eq!(case.duplicates, 0, "{s}: {:?}", case.committed);
        assert_eq!(case.after_rollback, case.rolled_back, "{s}");
        match s {
            SequenceStrategy::AdvisoryLock | SequenceStrategy::CounterRow => {
                assert!(case.invariant_held(), "{s}: {case:?}");
                assert_eq!(case.b_waited_for, ["A"], "{s}");
                assert!(case.c_waited_for.is_empty(), "{s}: {:?}", case.c_waited_for);
            }
            SequenceStrategy::TableLock => {
                assert!(case.other_scope_waited(), "{s}");
                assert_eq!((case.gaps, case.failed_declarations()), (0, 0), "{s}");
            }
            SequenceStrategy::SelectForUpdate => {
                assert_eq!(case.failed_declarations(), 1, "{s}: {:?}", case.b);
                assert!(!case.other_scope_waited(), "{s}");
            }
            other => panic!("no expectation written for {other}"),
        }
    }
    for o in &race.under_repeatable_read {
        assert_eq!(o.refused, !o.strategy.accepts("repeatable read"), "{o:?}");
    }
    db.close().await
}

/// The duplicate-incident race (T00-T10): two workers, one entity, both read
/// "none open", both evaluate, both create. Two transactions and REPEATABLE
/// READ leave two open incidents; the others one. The guard refuses the second
/// write with one conflict and holds no connection while evaluating.
#[tokio::test]
async fn guard_two_workers_one_entity_under_each_strategy() -> anyhow::Result<()> {
    let db = RunDatabase::for_tests("races").await?;
    let race = guard::replay(&db).await?;
    assert_eq!(race.cases.len(), guard::RACED.len());
    for case in &race.cases {
        let s = case.strategy.name();
        let expected = if case.strategy.safe() { 1 } else { 2 };
        assert_eq!(case.open_incidents, expected, "{s}");
    }
    let guard = race
        .cases
        .iter()
        .find(|c| c.strategy == GuardStrategy::Guard)
        .expect("the guard is raced");
    assert_eq!(guard.conflicts, 1);
    assert!(!guard.held_during_evaluation);
    let session_lock = race
        .cases
        .iter()
        .find(|c| c.strategy == GuardStrategy::SessionLock)
        .expect("the session lock is raced");
    assert!(session_lock.held_during_evaluation);
    db.close().await
}

/// An SQS worker's duplicate execution, one job delivered twice. With
/// no guard both deliveries transition and run the side effect; the
/// conditional UPDATE transitions once, the second delivery is told
/// `AlreadyHandled` and the first result stands, but both ran the side
/// effect; the two-phase claim's loser sees `JobBusy` and skips it; the
/// dedupe key skips the duplicate's effect. A crashed claimer's job is
/// `JobBusy` to the redelivery until the reaper returns it, then that
/// message completes it; a worker whose lease was taken over cannot
/// overwrite the new owner's result; a heartbeat keeps the lease.
#[tokio::test]
async fn jobs_one_job_delivered_twice_under_each_guard() -> anyhow::Result<()> {
    let db = RunDatabase::for_tests("races").await?;
    let race = jobs::replay(&db).await?;
    assert_eq!(race.cases.len(), JobCaseName::ALL.len());
    let busy = Delivery::JobBusy(JobStatus::Processing);

    let no_guard = race.case(JobCaseName::NoGuard);
    assert_eq!((no_guard.transitions, no_guard.side_effects), (2, 2));
    assert!(!no_guard.invariant_held());

    let where_status = race.case(JobCaseName::WhereStatus);
    assert_eq!(
        (where_status.transitions, where_status.side_effects),
        (1, 2)
    );
    assert_eq!(where_status.second, Delivery::AlreadyHandled);
    assert_eq!(where_status.final_status, "completed");
    assert_eq!(where_status.final_result, Some(json!({"by": "A"})));

    let two_phase = race.case(JobCaseName::TwoPhase);
    assert_eq!((two_phase.transitions, two_phase.side_effects), (1, 1));
    assert_eq!(two_phase.second, busy);
    assert_eq!(two_phase.final_status, "completed");
    assert!(two_phase.invariant_held());

    let dedupe_key = race.case(JobCaseName::DedupeKey);
    assert_eq!((dedupe_key.transitions, dedupe_key.side_effects), (1, 1));
    assert_eq!(dedupe_key.second, Delivery::SkippedDuplicateKey);

    let crash = race.case(JobCaseName::Crash);
    assert_eq!(crash.redelivery_while_stuck, Some(busy));
    assert_eq!(crash.reaped, Some(1));
    assert_eq!(crash.second, Delivery::Applied);
    assert_eq!(
        (crash.final_status.as_str(), crash.side_effects),
        ("completed", 1)
    );

    let late = race.case(JobCaseName::LateCompletion);
    assert_eq!(late.reaped, Some(1));
    assert_eq!(late.second, Delivery::LeaseLost);
    assert_eq!(late.final_result, Some(json!({"by": "B"})));
    assert_eq!(late.transitions, 1);

    let heartbeat = race.case(JobCaseName::LateCompletionHeartbeat);
    assert_eq!(heartbeat.reaped, Some(0));
    assert_eq!(heartbeat.second, Delivery::Applied);
    assert_eq!(heartbeat.final_result, Some(json!({"by": "A"})));
    assert_eq!(heartbeat.side_effects, 1);

    for case in &race.cases {
        assert!(case.as_expected(), "{:?}", case.name);
    }
    db.close().await
}
