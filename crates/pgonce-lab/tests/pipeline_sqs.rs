//! The incident service run under faults ([`pgonce_lab::incident_run`])
//! with its observations on SQS (a local moto server): duplicate sends
//! within SQS's deduplication window, a visibility timeout shorter than
//! some evaluations (so a message is delivered again while its first
//! worker still evaluates, and that worker's stale receipt still deletes:
//! SQS does not fence it), and one worker runtime killed mid-message. I1,
//! I2, I3 and I6 hold afterwards, checked in the database. The verdict does
//! not depend on timing: the run waits for the pipeline to drain and every
//! notification to settle, and fails only on a violation or on work still
//! pending at a deadline far above what the run needs.

use pgonce_incidents::config::SqsSection;
use pgonce_incidents::runtime::sqs_observations_queue;
use pgonce_lab::incident_run::{self, IncidentRunConfig, SqsAudit};
use pgonce_sqs::{SqsClient, SqsConfig};
use pgonce_testkit::{Moto, fresh_database};
use std::time::Duration;
use tracing_subscriber::util::SubscriberInitExt as _;

#[tokio::test]
async fn the_pipeline_on_sqs_keeps_every_invariant_under_redelivery_and_a_killed_worker() {
    // Shown only when the test fails: a run that does not end says where
    // it stood.
    let _logs = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("info,aws_smithy_runtime=warn,aws_config=warn,hyper=warn")
        .finish()
        .set_default();
    let moto = Moto::start().unwrap_or_else(|e| panic!("{e}"));
    let db = fresh_database().await;
    let pool = db.pool(30).await.unwrap();
    let config = IncidentRunConfig::quick().whole_second_visibility();
    let sqs = SqsClient::connect(SqsConfig::local(moto.endpoint()))
        .await
        .unwrap();
    let section = SqsSection::default();
    let queue = sqs_observations_queue(&sqs, &section, config.visibility, config.max_receive_count)
        .await
        .unwrap();
    let audit = SqsAudit {
        observations: queue.clone(),
        dead_letters: sqs.open(section.dead_letter_name()).await.unwrap(),
    };
    // The drain and the settle end at a stall, so a run past this is stuck
    // (a failure with its logs, rather than the harness's kill without
    // them).
    let outcome = tokio::time::timeout(
        Duration::from_secs(900),
        incident_run::run_on(&pool, &config, queue, audit, None, None),
    )
    .await
    .expect("the run is stuck")
    .unwrap();
    assert_eq!(outcome.backend, "sqs");
    assert!(outcome.drained && outcome.settled, "{outcome:#?}");
    assert!(outcome.all_hold(), "{outcome:#?}");
    // The faults happened: deliveries beyond one per message (the slow
    // tail outlived its visibility timeout, the killed runtime's messages
    // came back), and the malformed messages reached SQS's dead-letter
    // queue.
    assert!(outcome.pipeline.redeliveries > 0, "{outcome:#?}");
    assert_eq!(
        outcome.observations.malformed_dead_lettered,
        outcome.produced.malformed
    );
    assert!(outcome.tallies.incidents > 0);
    assert_eq!(outcome.tallies.notifications, outcome.tallies.incidents);
    assert_eq!(
        outcome.receiver.accepted as i64, outcome.tallies.incidents,
        "one accepted key per incident"
    );
    // SQS does not say which sends it dropped as duplicates.
    assert_eq!(outcome.produced.dropped_by_dedup, None);
}
