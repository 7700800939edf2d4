//! A standard receive's pick (`pgonce.queue_pick_standard`, migration
//! 0160) is a VOLATILE function: its query takes a snapshot of its own, a
//! little newer than the receive statement's, whose updates act on what
//! the pick locked. A message committed between the two snapshots, by a
//! transaction that began before the receive (so that it is visible by the
//! receive's `now()`), is locked by the pick but unseen by the statement:
//! not delivered, not lost, and reported as `unseen` so that the receive
//! looks again (receive_report.sql).
//!
//! Step by step: the function is replaced by a copy that, in the session
//! named `R` only, waits on advisory lock [`BEFORE_PICK`] before its query
//! (the statement's snapshot is taken, the pick's not yet) and on
//! [`AFTER_PICK`] after it (rows locked, not yet updated). Each step waits
//! until R is seen waiting in `pg_locks`.

use std::time::Duration;

use pgonce::{
    PgQueue, PgQueueOptions, Queue, QueueAttributes, ReceiveRequest, Received, SendMessage,
};
use pgonce_testkit::{Blocked, Interleaving, ScratchDatabase, Session, fresh_database};
use sqlx::PgPool;

const BEFORE_PICK: i64 = 5151;
const AFTER_PICK: i64 = 5152;
/// Deliveries in these tests never run out by themselves.
const LONG: Duration = Duration::from_secs(600);

/// The pick, gated in sessions named R: [`BEFORE_PICK`] before its query,
/// [`AFTER_PICK`] after it.
const GATED_PICK: &str = r#"DO $$
DECLARE d text;
BEGIN
    d := pg_get_functiondef('pgonce.queue_pick_standard(text, bigint, bigint[])'::regprocedure);
    IF position(E'BEGIN\n' in d) = 0 OR position(E'SKIP LOCKED;\n' in d) = 0 THEN
        RAISE EXCEPTION 'unexpected definition: %', d;
    END IF;
    d := replace(d, E'BEGIN\n', E'BEGIN\n    IF current_setting(''application_name'') LIKE ''%:R'' THEN PERFORM pg_advisory_xact_lock_shared(5151); END IF;\n');
    d := replace(d, E'SKIP LOCKED;\n', E'SKIP LOCKED;\n    IF current_setting(''application_name'') LIKE ''%:R'' THEN PERFORM pg_advisory_xact_lock_shared(5152); END IF;\n');
    EXECUTE d;
END $$;"#;

/// A database with the gated pick; H holds the gates, R receives.
struct GatedPick {
    _db: ScratchDatabase,
    setup: PgPool,
    race: Interleaving,
    h: Session,
    r: Session,
}

impl GatedPick {
    async fn new() -> GatedPick {
        let db = fresh_database().await;
        let setup = db.pool(8).await.unwrap();
        pgonce::migrate(&setup).await.unwrap();
        sqlx::raw_sql(GATED_PICK).execute(&setup).await.unwrap();
        let race = Interleaving::new(db.options()).await.unwrap();
        let h = race.session("H").await.unwrap();
        let r = race.session("R").await.unwrap();
        GatedPick {
            _db: db,
            setup,
            race,
            h,
            r,
        }
    }

    async fn queue(&self, name: &str) -> PgQueue {
        PgQueue::create(
            &self.setup,
            name,
            QueueAttributes::default(),
            PgQueueOptions::default(),
        )
        .await
        .unwrap()
    }

    async fn hold(&self, gate: i64) {
        let held = sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(gate)
            .execute(self.h.pool());
        self.race.try_step(&self.h, "hold", held).await.unwrap();
    }

    async fn open(&self, gate: i64) {
        let opened = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(gate)
            .execute(self.h.pool());
        self.race.try_step(&self.h, "open", opened).await.unwrap();
    }

    /// R's receive from `queue`, seen waiting before its pick.
    async fn receive_held(
        &self,
        queue: &str,
        request: ReceiveRequest,
    ) -> Blocked<pgonce::Result<Vec<Received>>> {
        let handle = PgQueue::open(self.r.pool(), queue, PgQueueOptions::default())
            .await
            .unwrap();
        let blocked = self
            .race
            .step_blocks(
                &self.r,
                "receive",
                async move { handle.receive(request).await },
            )
            .await
            .unwrap();
        assert_eq!(blocked.blocked_by(), ["H"]);
        self.wait_at(BEFORE_PICK).await;
        blocked
    }

    /// Waits until R waits for advisory lock `gate` (polls `pg_locks`).
    async fn wait_at(&self, gate: i64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let waiting: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                 WHERE a.application_name LIKE '%:R' AND a.datname = current_database()
                   AND NOT l.granted AND l.locktype = 'advisory'
                   AND l.objid = $1::bigint::oid)",
            )
            .bind(gate)
            .fetch_one(&self.setup)
            .await
            .unwrap();
            if waiting {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "R never waited at gate {gate}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// (receive_count, generation) of message `id`.
    async fn counts(&self, id: &str) -> (i32, i64) {
        #[derive(sqlx::FromRow)]
        struct Counts {
            receive_count: i32,
            generation: i64,
        }
        let row: Counts = sqlx::query_as(
            "SELECT receive_count, generation FROM pgonce.queue_message WHERE id = $1",
        )
        .bind(id.parse::<i64>().unwrap())
        .fetch_one(&self.setup)
        .await
        .unwrap();
        (row.receive_count, row.generation)
    }
}

fn bodies(got: &[Received]) -> Vec<&str> {
    got.iter().map(|m| m.body.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_whose_only_place_went_to_an_unseen_message_looks_again() {
    // B is sent in a transaction begun before A is sent, so B sorts first
    // (its visible_at is its transaction's start). B commits while R's
    // receive of one waits before its pick: the pick locks B, the first
    // statement cannot see it, and A was not picked. Reporting B as unseen
    // makes the receive look again, which delivers B. (Ignoring it
    // returned nothing from a queue holding two receivable messages.)
    let t = GatedPick::new().await;
    let q = t.queue("only-place").await;
    let mut tx = t.setup.begin().await.unwrap();
    let b = q.send_in(&mut tx, SendMessage::new("B")).await.unwrap();
    let a = q.send(SendMessage::new("A")).await.unwrap();
    t.hold(BEFORE_PICK).await;
    let receiving = t
        .receive_held("only-place", ReceiveRequest::up_to(1).visibility(LONG))
        .await;
    tx.commit().await.unwrap();
    t.open(BEFORE_PICK).await;
    let got = receiving.resume().await.unwrap().unwrap();
    assert_eq!(
        bodies(&got),
        ["B"],
        "the unseen message, taken by a second look"
    );
    assert_eq!(got[0].receive_count, 1);
    assert_eq!(t.counts(&b.id).await, (1, 1), "B delivered once");
    assert_eq!(t.counts(&a.id).await, (0, 0), "A untouched");
    let next = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&next), ["A"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_committed_between_the_snapshots_is_held_then_delivered_once() {
    // A is visible; B commits while R's receive of ten waits before its
    // pick. At the gate after the pick, R holds both rows: a receive beside
    // it gets nothing. Then R delivers A in its first statement and B,
    // unseen there, in the next: each exactly once.
    let t = GatedPick::new().await;
    let q = t.queue("between").await;
    let a = q.send(SendMessage::new("A")).await.unwrap();
    let mut tx = t.setup.begin().await.unwrap();
    let b = q.send_in(&mut tx, SendMessage::new("B")).await.unwrap();
    t.hold(BEFORE_PICK).await;
    t.hold(AFTER_PICK).await;
    let receiving = t
        .receive_held("between", ReceiveRequest::up_to(10).visibility(LONG))
        .await;
    tx.commit().await.unwrap();
    t.open(BEFORE_PICK).await;
    t.wait_at(AFTER_PICK).await;
    let beside = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert!(beside.is_empty(), "R holds A and B: {:?}", bodies(&beside));
    t.open(AFTER_PICK).await;
    let got = receiving.resume().await.unwrap().unwrap();
    assert_eq!(bodies(&got), ["A", "B"]);
    assert_eq!(t.counts(&a.id).await, (1, 1));
    assert_eq!(t.counts(&b.id).await, (1, 1));
    for delivery in &got {
        q.delete(&delivery.receipt).await.unwrap();
    }
    assert!(
        q.receive(ReceiveRequest::up_to(10))
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_killed_after_its_pick_locked_leaves_the_messages_as_they_were() {
    // R's receive has locked A and B in its pick and not yet updated them
    // when its backend is terminated: the statement rolls back, the locks
    // go with it, and the next receive gets both, first delivery each.
    let t = GatedPick::new().await;
    let q = t.queue("killed").await;
    let a = q.send(SendMessage::new("A")).await.unwrap();
    let b = q.send(SendMessage::new("B")).await.unwrap();
    t.hold(AFTER_PICK).await;
    let receiving = t
        .race
        .step_blocks(&t.r, "receive", {
            let handle = PgQueue::open(t.r.pool(), "killed", PgQueueOptions::default())
                .await
                .unwrap();
            async move { handle.receive(ReceiveRequest::up_to(10)).await }
        })
        .await
        .unwrap();
    t.wait_at(AFTER_PICK).await;
    // With a timeout, pg_terminate_backend returns once the backend has
    // exited, its transaction aborted and its row locks released: the
    // client hears of the termination before that, so a receive right
    // after the error could still find A and B locked and skip them.
    // R's backend is found as `wait_at` found it, by its lock request not
    // granted: pg_stat_activity reports the wait a moment after pg_locks
    // shows the request, and in that moment a filter on `wait_event_type`
    // found no backend.
    let killed: bool = sqlx::query_scalar(
        "SELECT pg_terminate_backend(a.pid, 60000)
         FROM pg_locks l JOIN pg_stat_activity a USING (pid)
         WHERE a.application_name LIKE '%:R' AND a.datname = current_database()
           AND NOT l.granted AND l.locktype = 'advisory'
           AND l.objid = $1::bigint::oid",
    )
    .bind(AFTER_PICK)
    .fetch_one(&t.setup)
    .await
    .unwrap();
    assert!(killed);
    let outcome = receiving.resume().await.unwrap();
    assert!(outcome.is_err(), "the killed receive reported {outcome:?}");
    assert_eq!(t.counts(&a.id).await, (0, 0));
    assert_eq!(t.counts(&b.id).await, (0, 0));
    let next = q.receive(ReceiveRequest::up_to(10)).await.unwrap();
    assert_eq!(bodies(&next), ["A", "B"]);
    assert!(next.iter().all(|m| m.receive_count == 1));
}
