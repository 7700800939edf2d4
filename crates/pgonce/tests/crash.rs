//! The job, idempotency-key and sequence safeguards and the event store's
//! catch-up subscription across a server crash, on a cluster of their own
//! (the shared test server keeps running for the other tests): an
//! immediate shutdown (SIGQUIT, no checkpoint, crash recovery at the next
//! start) with committed leases, holds, numbers and events beside ones
//! still uncommitted.

use std::time::Duration;

use pgonce::dedupe::{self, Acquired};
use pgonce::events::{AppendStrategy, Event, EventStore, EventStoreConfig, SubscriptionConfig};
use pgonce::job::{self, JobStatus, NewJob};
use pgonce::{Error, IsolationLevel, Listen, NumberedTable, Sequence, SequenceConfig};
use pgonce_testkit::{Cluster, ShutdownMode};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const LEASE: Duration = Duration::from_secs(60);

async fn connect(cluster: &Cluster) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .connect(&cluster.url("postgres"))
        .await
        .unwrap()
}

/// A throwaway cluster of the test's own.
async fn start() -> Cluster {
    tokio::task::spawn_blocking(Cluster::start)
        .await
        .unwrap()
        .unwrap()
}

/// Kills `cluster` by an immediate shutdown and starts it again (crash
/// recovery); returns it once it takes connections.
async fn crash_and_restart(mut cluster: Cluster) -> Cluster {
    tokio::task::spawn_blocking(move || {
        cluster.restart(ShutdownMode::Immediate).unwrap();
        cluster
    })
    .await
    .unwrap()
}

async fn status(pool: &PgPool, id: i64) -> JobStatus {
    job::get(pool, id).await.unwrap().unwrap().status().unwrap()
}

/// What committed before the crash holds after it; what did not is gone,
/// and nothing is left half-held:
///
/// * a lease whose claim committed completes its job after the restart;
///   a lease whose claim was still open is lost (its job is pending and
///   claimable), not a retry that never ends;
/// * a committed idempotency hold is finished by its holder, and the
///   retry replays the response;
/// * a number taken in a transaction the crash cut short is handed out
///   again: the scope stays 1..n.
#[tokio::test]
async fn what_committed_survives_a_crash_and_what_did_not_is_neither_held_nor_lost() {
    let cluster = start().await;
    let pool = connect(&cluster).await;
    pgonce::migrate(&pool).await.unwrap();
    sqlx::query(
        "CREATE TABLE public.incidents (org text NOT NULL, number bigint NOT NULL, \
         UNIQUE (org, number))",
    )
    .execute(&pool)
    .await
    .unwrap();
    let incidents = Sequence::new(
        NumberedTable::new("public.incidents", "org", "number").unwrap(),
        SequenceConfig::default(),
    )
    .unwrap();
    let declare = async |pool: &PgPool| -> pgonce::Result<i64> {
        let tx = pgonce::begin(pool, IsolationLevel::ReadCommitted).await?;
        let declared = incidents
            .commit_numbered(tx, &"acme", async |conn: &mut sqlx::PgConnection, n| {
                sqlx::query("INSERT INTO public.incidents VALUES ('acme', $1)")
                    .bind(n)
                    .execute(conn)
                    .await?;
                Ok(())
            })
            .await?;
        Ok(declared.number)
    };

    // Committed before the crash.
    let committed_job = job::enqueue(&pool, &NewJob::new("send", json!({})))
        .await
        .unwrap();
    let committed_lease = job::claim(&pool, committed_job, LEASE).await.unwrap();
    let fp = dedupe::fingerprint(&json!("req")).unwrap();
    let Acquired::Process(hold) = dedupe::acquire(&pool, "api", "k", &fp, LEASE)
        .await
        .unwrap()
    else {
        panic!("a new key");
    };
    assert_eq!(declare(&pool).await.unwrap(), 1);
    let open_job = job::enqueue(&pool, &NewJob::new("send", json!({})))
        .await
        .unwrap();

    // Open when the server dies: a number taken and written, a claim.
    let mut numbering = pgonce::begin(&pool, IsolationLevel::ReadCommitted)
        .await
        .unwrap();
    let taken = incidents.next(&mut numbering, &"acme").await.unwrap();
    assert_eq!(taken.number, 2);
    sqlx::query("INSERT INTO public.incidents VALUES ('acme', 2)")
        .execute(&mut *numbering)
        .await
        .unwrap();
    let mut claiming = pool.begin().await.unwrap();
    let open_lease = job::claim(&mut *claiming, open_job, LEASE).await.unwrap();

    let mut cluster = crash_and_restart(cluster).await;
    // The old connections died with the server.
    drop((numbering, claiming));
    pool.close().await;
    let pool = connect(&cluster).await;

    job::complete(&pool, &committed_lease, &json!("done"))
        .await
        .unwrap();
    assert_eq!(status(&pool, committed_job).await, JobStatus::Completed);
    let out = job::complete(&pool, &open_lease, &json!("done")).await;
    assert!(matches!(out, Err(Error::LeaseLost { .. })), "{out:?}");
    assert_eq!(status(&pool, open_job).await, JobStatus::Pending);
    job::claim(&pool, open_job, LEASE).await.unwrap();

    dedupe::finish(&pool, &hold, &json!({"id": 7}))
        .await
        .unwrap();
    let replay = dedupe::acquire(&pool, "api", "k", &fp, LEASE)
        .await
        .unwrap();
    assert_eq!(replay, Acquired::Replay(json!({"id": 7})));

    assert_eq!(declare(&pool).await.unwrap(), 2);
    let numbers: Vec<i64> =
        sqlx::query_scalar("SELECT number FROM public.incidents ORDER BY number")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(numbers, [1, 2]);
    pool.close().await;
    cluster.stop();
}

/// A subscription waiting at a gap when the server crashes delivers, after
/// the restart, the events committed before the crash, without waiting for
/// anyone else to write.
///
/// The gap: position 1 appended and still open, 2 committed. The reader
/// took its own transaction id as the gap's bound, one id above one taken
/// by a transaction that wrote nothing yet (an append between its id and
/// its insert). Neither id reached the WAL: a transaction that wrote
/// nothing commits without waiting for the flush (`wal_writer_delay` is
/// raised so that the crash comes before the background flush). Recovery
/// hands both ids out again, so the server's oldest running id stayed
/// below the bound after the restart, and the subscription waited at the
/// gap, poll after poll, until other transactions had used up the ids.
#[tokio::test]
async fn a_subscription_waiting_at_a_gap_when_the_server_crashes_goes_on_after_the_restart() {
    let cluster = start().await;
    let pool = connect(&cluster).await;
    pgonce::migrate(&pool).await.unwrap();
    sqlx::query("ALTER SYSTEM SET wal_writer_delay = '10s'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&pool)
        .await
        .unwrap();
    let store = EventStore::new(
        pool.clone(),
        EventStoreConfig {
            strategy: AppendStrategy::AdvisoryLocks,
            notify: false,
            ..Default::default()
        },
    )
    .unwrap();
    let open = store
        .begin_append(&[Event::new("Lost")], None)
        .await
        .unwrap();
    assert_eq!(open.positions(), [1]);
    let committed = store.append(&[Event::new("Kept")], None).await.unwrap();
    assert_eq!(committed.positions, [2]);
    let mut id_only = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *id_only)
        .await
        .unwrap();
    let mut subscription = store
        .subscribe(SubscriptionConfig {
            listen: Listen::Off,
            ..SubscriptionConfig::default()
        })
        .await
        .unwrap();
    let first = subscription.run_once().await.unwrap();
    assert!(
        first.events.is_empty() && first.counters.waiting_on_gap,
        "{first:?}"
    );

    let mut cluster = crash_and_restart(cluster).await;
    // The old connections died with the server; the subscription's pool
    // opens new ones.
    drop((open, id_only));

    // Two polls: one sees the gap afresh and takes a new bound, the next
    // passes it. Nothing else is written meanwhile.
    let mut delivered = Vec::new();
    let mut polls = Vec::new();
    for _ in 0..3 {
        let polled = subscription.run_once().await.unwrap();
        delivered.extend(polled.events.iter().map(|e| e.position));
        polls.push(polled.counters);
    }
    assert_eq!(delivered, [2], "after the restart: {polls:?}");
    assert_eq!(subscription.horizon(), 2);
    pool.close().await;
    cluster.stop();
}
