//! The adversary's own proof: each deliberate bug (a mutant) is caught
//! within 100 rounds, the failing round it reports replays to the same
//! violation, both from (seed, round) and from its saved, shrunk
//! schedule; and with no mutant each scenario runs clean under every
//! fault the shared test cluster allows (a restart needs the run's own
//! throwaway cluster, so it is skipped here and counted as not injected).
//!
//! Verdicts rest on the schedule alone: steps run one at a time, a
//! blocked step is seen in `pg_locks`, expiries are forced, so a busy
//! machine changes how long these take, never what they find.

use pgonce_lab::chaos::{self, ChaosConfig, Mutant, SavedRound, ScenarioKind};
use pgonce_lab::scratch::RunDatabase;

const SEED: u64 = 20261125;

/// Runs `mutant` against `scenario` until the first failing round, then
/// replays that round twice: by (seed, round), and from the saved file.
async fn mutant_is_caught(scenario: ScenarioKind, mutant: Mutant, invariant: &str) {
    let db = RunDatabase::for_tests("chaos_mutant").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = ChaosConfig::new(SEED, 100);
    config.scenarios = vec![scenario];
    config.mutant = Some(mutant);
    config.stop_at_first = true;
    config.failures_dir = Some(dir.path().to_path_buf());
    let outcome = chaos::run_on(&db, &config).await.unwrap();
    let found = outcome
        .found
        .first()
        .unwrap_or_else(|| panic!("{mutant:?} not caught in 100 rounds: {outcome:#?}"));
    assert_eq!(found.violation.invariant, invariant, "{found:#?}");
    assert!(found.shrunk.len() <= found.original_steps);

    // By seed and round: the round's schedule is drawn again.
    let mut again = config.clone();
    again.round = Some(found.round);
    again.failures_dir = None;
    let replayed = chaos::run_on(&db, &again).await.unwrap();
    assert!(
        replayed
            .found
            .iter()
            .any(|f| f.round == found.round && f.violation.invariant == invariant),
        "seed {SEED} round {} did not reproduce: {replayed:#?}",
        found.round
    );

    // From the saved file: the shrunk schedule alone shows it.
    let path = found.saved.as_ref().expect("the failing round is saved");
    let saved: SavedRound = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(
        (saved.seed, saved.round, saved.mutant),
        (SEED, found.round, Some(mutant))
    );
    let mut from_file = ChaosConfig::new(saved.seed, 1);
    from_file.mutant = saved.mutant;
    from_file.replay = Some(saved.clone());
    let replayed = chaos::run_on(&db, &from_file).await.unwrap();
    assert!(
        replayed
            .found
            .iter()
            .any(|f| f.violation.invariant == invariant),
        "the saved schedule {:?} did not reproduce: {replayed:#?}",
        saved.schedule
    );
    db.close().await.unwrap();
}

#[tokio::test]
async fn the_guard_switched_off_is_caught_opening_two_incidents() {
    mutant_is_caught(ScenarioKind::Guard, Mutant::GuardOff, chaos::checker::I1).await;
}

#[tokio::test]
async fn a_sequence_taken_with_select_for_update_is_caught_computing_one_number_twice() {
    mutant_is_caught(
        ScenarioKind::Sequence,
        Mutant::SequenceForUpdate,
        chaos::checker::I2,
    )
    .await;
}

#[tokio::test]
async fn a_queue_delete_that_ignores_the_receipts_generation_is_caught() {
    mutant_is_caught(
        ScenarioKind::Queue,
        Mutant::QueueStaleDelete,
        chaos::checker::I6,
    )
    .await;
}

/// Caught only because the checker holds every job the round enqueued to
/// account: the deleted job leaves no row for a check of rows to see.
#[tokio::test]
async fn a_reaper_that_deletes_an_expired_job_is_caught_losing_it() {
    mutant_is_caught(
        ScenarioKind::Jobs,
        Mutant::JobsReaperDelete,
        chaos::checker::I3,
    )
    .await;
}

/// Caught only because appends are interleaved step by step: the raw
/// writer's insert must be in flight while a conditional append checks
/// and commits.
#[tokio::test]
async fn a_writer_that_skips_the_publishing_keys_is_caught_under_a_condition() {
    mutant_is_caught(
        ScenarioKind::Events,
        Mutant::EventsRawInsert,
        chaos::checker::I5,
    )
    .await;
}

/// Without a mutant, 20 rounds of each light scenario under every fault
/// find nothing.
#[tokio::test]
async fn every_scenario_runs_clean_under_faults() {
    let db = RunDatabase::for_tests("chaos_clean").await.unwrap();
    let light = ScenarioKind::ALL
        .into_iter()
        .filter(|s| *s != ScenarioKind::Pipeline);
    for scenario in light {
        let mut config = ChaosConfig::new(SEED, 20);
        config.scenarios = vec![scenario];
        let outcome = chaos::run_on(&db, &config).await.unwrap();
        assert!(
            outcome.found.is_empty(),
            "{scenario:?}: {:#?}",
            outcome.found
        );
        assert_eq!(outcome.rounds.get(&scenario), Some(&20));
        assert!(
            outcome.faults.values().sum::<u64>() > 0,
            "{scenario:?}: no fault injected"
        );
    }
    db.close().await.unwrap();
}

/// One round of the whole incident pipeline (webhook faults; no restart
/// on the shared cluster) keeps I1, I2, I3 and I6, in a database of its
/// own that is dropped afterwards.
#[tokio::test]
async fn the_pipeline_round_runs_clean() {
    let db = RunDatabase::for_tests("chaos_pipeline").await.unwrap();
    let mut config = ChaosConfig::new(SEED, 1);
    config.scenarios = vec![ScenarioKind::Pipeline];
    let outcome = chaos::run_on(&db, &config).await.unwrap();
    assert!(outcome.found.is_empty(), "{:#?}", outcome.found);
    assert_eq!(outcome.rounds.get(&ScenarioKind::Pipeline), Some(&1));
    db.close().await.unwrap();
}
