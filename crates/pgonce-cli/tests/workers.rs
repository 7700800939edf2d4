//! Two `pgonce worker` processes (the built binary) sharing one database
//! and one observations queue, as two machines of a deployment would: both
//! take messages, one is killed with SIGKILL mid-run (no ack, no
//! heartbeat, no completion), and afterwards nothing is lost and I1, I2,
//! I3 and I6 hold, checked in the database. Every wait polls for a state
//! (a metric above zero, the queue empty), bounded by a generous deadline
//! that only a stuck run reaches: the verdict is about what the database
//! holds, never about how fast it got there.

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pgonce::{PgQueue, Queue, SendMessage};
use pgonce_incidents::invariants;
use pgonce_incidents::model::{Observation, Op, Rule, Singleton};
use pgonce_incidents::runtime::observations_queue;
use pgonce_incidents::store;
use pgonce_testkit::webhook::{ReceiverFaults, WebhookReceiver};
use serde_json::json;
use sqlx::PgPool;

mod common;

use common::{
    Reaped, Stderr, blocked_backend, free_port, fresh_database_url, http_get, open_gate,
    wait_for_200,
};

/// How long a stuck run may take before the test gives up on it.
const STUCK: Duration = Duration::from_secs(180);

/// A `pgonce worker` on `url`, its metrics on `port`, sending
/// notifications to `webhook`. Short visibility timeout and lease, so a
/// killed worker's messages and claims come back within seconds.
fn worker(url: &str, port: u16, webhook: &str) -> Child {
    Command::new(assert_cmd::cargo::cargo_bin("pgonce"))
        .arg("worker")
        .env_remove("DATABASE_URL")
        .env("PGONCE_DATABASE__URL", url)
        .env("PGONCE_API__METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .env("PGONCE_PIPELINE__WORKERS", "1")
        .env("PGONCE_PIPELINE__CONCURRENCY", "4")
        .env("PGONCE_PIPELINE__VISIBILITY_TIMEOUT", "2s")
        .env("PGONCE_PIPELINE__MAX_RECEIVE_COUNT", "50")
        .env("PGONCE_PIPELINE__EVALUATOR__LATENCY", "20ms")
        .env("PGONCE_PIPELINE__EVALUATOR__JITTER", "40ms")
        .env("PGONCE_NOTIFIER__WEBHOOK_URL", webhook)
        .env("PGONCE_NOTIFIER__LEASE", "2s")
        .env("PGONCE_NOTIFIER__TIMEOUT", "1s")
        .env("PGONCE_NOTIFIER__RETRY__BASE", "100ms")
        .env("PGONCE_NOTIFIER__RETRY__MAX", "500ms")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("pgonce worker starts")
}

/// Observations this worker process finished, from its `/metrics`.
fn processed(port: u16) -> u64 {
    let metrics = http_get(port, "/metrics").unwrap_or_default();
    metrics
        .lines()
        .find(|l| l.starts_with("pgonce_incidents_observations_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

struct Org {
    id: i64,
    entities: Vec<String>,
}

async fn set_up(pool: &PgPool) -> Org {
    let (org, _key) = store::create_organization(pool, "two-workers")
        .await
        .unwrap();
    for (name, singleton) in [
        ("cpu-one", Singleton::Always),
        ("cpu-many", Singleton::Never),
    ] {
        let rule = Rule {
            attribute: "cpu".into(),
            op: Op::Gt,
            value: 50.0,
        };
        store::create_policy(pool, org.id, name, singleton, &rule)
            .await
            .unwrap();
    }
    let entities = (0..8).map(|e| format!("svc-{e}")).collect::<Vec<_>>();
    for e in &entities {
        store::upsert_entity(pool, org.id, e, &json!({}))
            .await
            .unwrap();
    }
    Org {
        id: org.id,
        entities,
    }
}

/// Sends `n` observations (ids `from..from + n`), each with a group (its
/// entity) and a deduplication id; returns the queue's ids.
async fn send(queue: &PgQueue, org: &Org, from: usize, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in from..from + n {
        let o = Observation {
            organization_id: org.id,
            entity: org.entities[i % org.entities.len()].clone(),
            attributes: json!({ "cpu": (i * 37) % 100 }),
            message_id: None,
        };
        let m = SendMessage::new(serde_json::to_string(&o).unwrap())
            .group(o.group())
            .dedup(format!("obs-{i}"));
        ids.push(queue.send(m).await.unwrap().id);
    }
    ids
}

#[test]
fn two_worker_processes_share_one_queue_and_a_sigkill_loses_nothing() {
    let (rt, db, url) = fresh_database_url();
    let pool = rt.block_on(db.pool(8)).unwrap();
    rt.block_on(pgonce_incidents::migrate(&pool)).unwrap();
    let org = rt.block_on(set_up(&pool));
    let receiver = rt
        .block_on(WebhookReceiver::start(ReceiverFaults::default()))
        .unwrap();
    let queue = rt
        .block_on(observations_queue(&pool, Duration::from_secs(2), 50))
        .unwrap();
    let (port_a, port_b) = (free_port(), free_port());
    let mut a = Reaped(worker(&url, port_a, receiver.url()));
    let mut b = Reaped(worker(&url, port_b, receiver.url()));
    wait_for_200(&mut a.0, port_a, "/readyz");
    wait_for_200(&mut b.0, port_b, "/readyz");

    // Produce until both processes have finished messages: which process
    // takes which message is the queue's business, so keep sending rather
    // than assume a split.
    let deadline = Instant::now() + STUCK;
    let mut sent: BTreeSet<String> = BTreeSet::new();
    let (mut by_a, mut by_b) = (0, 0);
    while by_a == 0 || by_b == 0 {
        assert!(
            Instant::now() < deadline,
            "a worker never processed: a {by_a}, b {by_b}"
        );
        sent.extend(rt.block_on(send(&queue, &org, sent.len(), 40)));
        std::thread::sleep(Duration::from_millis(300));
        (by_a, by_b) = (processed(port_a), processed(port_b));
    }
    // Messages in b's hands when it dies: more sent, then SIGKILL at once.
    sent.extend(rt.block_on(send(&queue, &org, sent.len(), 80)));
    b.0.kill().unwrap();
    b.0.wait().unwrap();
    sent.extend(rt.block_on(send(&queue, &org, sent.len(), 40)));

    // a finishes everything, b's deliveries included once their visibility
    // timeout ran out, and every incident's notification (b's claims come
    // back when their lease ends).
    let sent: Vec<String> = sent.into_iter().collect();
    let report = loop {
        assert!(Instant::now() < deadline, "the run is stuck");
        assert!(a.0.try_wait().unwrap().is_none(), "worker a exited");
        // The queue first: once it is drained (b's in flight come back
        // first, when their visibility timeout ends) no message is being
        // worked on, so no incident can appear after the check below.
        // (Checked the other way round, a message finished between the two
        // looked drained with its incident not yet notified.)
        let stats = rt.block_on(queue.stats()).unwrap();
        let report = rt
            .block_on(invariants::check(&pool, &[org.id], &sent))
            .unwrap();
        // Drained, and every incident notified. I1, I2 and I6 are then
        // checked, not waited for: a message deleted unprocessed fails I6
        // here.
        if stats.depth == 0 && stats.in_flight == 0 && stats.delayed == 0 && report.i3() {
            break report;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    let tallies = rt.block_on(invariants::tallies(&pool, &[org.id])).unwrap();
    let by_a_after = processed(port_a);
    eprintln!(
        "sent {}, processed by a {by_a_after} (before the kill {by_a}), by b before the kill \
         {by_b}; {} deliveries for {} messages; {} incidents, {} notified",
        sent.len(),
        tallies.deliveries_processed,
        tallies.messages_processed,
        tallies.incidents,
        tallies.notifications
    );
    assert!(report.all_hold(), "{report:#?}");
    assert_eq!(tallies.messages_processed as usize, sent.len());
    assert_eq!(tallies.notifications, tallies.incidents);
    assert!(tallies.incidents > 0);
    // a kept working after b died.
    assert!(by_a_after > by_a);
    let _ = Command::new("kill")
        .args(["-TERM", &a.0.id().to_string()])
        .status();
    a.0.wait().unwrap();
}

/// A `pgonce worker` on `url` with one pipeline worker and `settings`
/// (variables), logging at info (`runtime started`, `shutting down`) on
/// its piped stderr.
fn one_worker(url: &str, settings: &[(&str, &str)]) -> Reaped {
    Reaped(
        Command::new(assert_cmd::cargo::cargo_bin("pgonce"))
            .arg("worker")
            .env_remove("DATABASE_URL")
            .env("PGONCE_DATABASE__URL", url)
            .env("PGONCE_PIPELINE__WORKERS", "1")
            .envs(settings.iter().copied())
            .env("RUST_LOG", "warn,pgonce=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// SIGTERM while a `pgonce worker` has messages in hand: the ones that
/// finished were acked (deleted), the ones still in their handler at the
/// shutdown deadline are handed back, receivable at once rather than after
/// their visibility timeout, and the process exits 0.
#[test]
fn sigterm_mid_work_acks_what_finished_hands_back_the_rest_and_exits_0() {
    let (rt, db, url) = fresh_database_url();
    let pool = rt.block_on(db.pool(4)).unwrap();
    rt.block_on(pgonce_incidents::migrate(&pool)).unwrap();
    let busy = rt.block_on(set_up(&pool));
    // No policy: its observations finish at once, nothing to evaluate.
    let (quiet, _key) = rt
        .block_on(store::create_organization(&pool, "quiet"))
        .unwrap();
    let quiet = Org {
        id: quiet.id,
        entities: (0..4).map(|e| format!("quiet-{e}")).collect(),
    };
    // A minute of visibility: a message back on the queue in less was
    // handed back, not expired.
    let queue = rt
        .block_on(observations_queue(&pool, Duration::from_secs(60), 50))
        .unwrap();
    let finished = rt.block_on(send(&queue, &quiet, 0, 4));
    // One per entity: each its own group, so all are in hand at once.
    let held = rt.block_on(send(&queue, &busy, 100, 3));
    let mut child = one_worker(
        &url,
        &[
            ("PGONCE_PIPELINE__CONCURRENCY", "8"),
            ("PGONCE_PIPELINE__VISIBILITY_TIMEOUT", "60s"),
            ("PGONCE_PIPELINE__SHUTDOWN_DEADLINE", "1s"),
            // Evaluations that never finish while the test runs.
            ("PGONCE_PIPELINE__EVALUATOR__LATENCY", "1h"),
        ],
    );
    let stderr = Stderr::of(&mut child.0);
    let mut seen = Vec::new();
    stderr.wait_for("runtime started", &mut seen);

    // The quiet organization's messages done and deleted, the busy one's
    // all in hand.
    let deadline = Instant::now() + STUCK;
    loop {
        let stats = rt.block_on(queue.stats()).unwrap();
        if stats.depth == 0 && stats.in_flight == held.len() as u64 {
            break;
        }
        assert!(Instant::now() < deadline, "never all in hand: {stats:?}");
        assert!(child.0.try_wait().unwrap().is_none(), "the worker exited");
        std::thread::sleep(Duration::from_millis(100));
    }

    signal(&child.0, "TERM");
    stderr.wait_for("shutting down", &mut seen);
    stderr.wait_for("pgonce: stopped", &mut seen);
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status:?}:\n{}", seen.join("\n"));

    // Acked: the quiet ones are gone. Handed back: the held ones are all
    // receivable now, none in flight, though their visibility timeout has
    // most of its minute to run.
    let stats = rt.block_on(queue.stats()).unwrap();
    assert_eq!(stats.in_flight, 0, "{stats:?}:\n{}", seen.join("\n"));
    assert_eq!(stats.depth, held.len() as u64, "{stats:?}");
    let received = rt
        .block_on(queue.receive(pgonce::ReceiveRequest::up_to(10)))
        .unwrap();
    let mut back: Vec<String> = received.iter().map(|m| m.id.clone()).collect();
    back.sort();
    let mut expected = held.clone();
    expected.sort();
    assert_eq!(back, expected);
    assert!(finished.iter().all(|id| !back.contains(id)));
}

/// Sends the signal `name` (`TERM`, `INT`) to `child`.
fn signal(child: &Child, name: &str) {
    let sent = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// A second signal while a `pgonce worker` drains stops it at once. Its
/// handler is held mid-message: the test holds the message's entity row,
/// and the worker's upsert of it is seen blocked in `pg_blocking_pids`.
/// SIGTERM starts the drain (a shutdown deadline of an hour); SIGINT then
/// ends the process, while the row is still held, with exit 130 and one
/// line saying so (the second signal was ignored, and the process drained
/// on). The message was not acked: once its visibility timeout runs out
/// it is receivable again, and the pipeline's ledger has no row for it.
#[test]
fn a_second_signal_while_draining_stops_at_once_and_the_message_comes_back() {
    let (rt, db, url) = fresh_database_url();
    // Failed assertions drop the held transaction, which needs the runtime.
    let _runtime = rt.enter();
    let pool = rt.block_on(db.pool(4)).unwrap();
    rt.block_on(pgonce_incidents::migrate(&pool)).unwrap();
    let org = rt.block_on(set_up(&pool));
    let queue = rt
        .block_on(observations_queue(&pool, Duration::from_secs(2), 50))
        .unwrap();
    let (mut gate, holder) = open_gate(&rt, &pool);
    rt.block_on(
        sqlx::query(
            "SELECT 1 FROM incidents.entities \
             WHERE organization_id = $1 AND external_id = $2 FOR UPDATE",
        )
        .bind(org.id)
        .bind(&org.entities[0])
        .execute(&mut *gate),
    )
    .unwrap();
    // Observation 0 is the first entity's.
    let held = rt.block_on(send(&queue, &org, 0, 1));

    let mut child = one_worker(
        &url,
        &[
            ("PGONCE_PIPELINE__CONCURRENCY", "1"),
            ("PGONCE_PIPELINE__VISIBILITY_TIMEOUT", "2s"),
            ("PGONCE_PIPELINE__SHUTDOWN_DEADLINE", "1h"),
        ],
    );
    let stderr = Stderr::of(&mut child.0);
    blocked_backend(&rt, &pool, holder);
    let deadline = Instant::now() + STUCK;

    let mut seen = Vec::new();
    signal(&child.0, "TERM");
    stderr.wait_for("shutting down", &mut seen);
    signal(&child.0, "INT");
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the second signal did not stop the worker:\n{}",
            seen.join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // The process has exited: its stderr ends.
    seen.extend(stderr.0.iter());
    assert_eq!(status.code(), Some(130), "{status:?}:\n{}", seen.join("\n"));
    let last = seen.last().map(String::as_str).unwrap_or_default();
    assert!(
        last.starts_with("pgonce: interrupted again (SIGINT) while stopping"),
        "{}",
        seen.join("\n")
    );
    assert!(!last.contains("stopped;"), "{}", seen.join("\n"));
    rt.block_on(gate.rollback()).unwrap();

    // Not acked: back on the queue once its visibility timeout ran out, and
    // not in the ledger.
    loop {
        let stats = rt.block_on(queue.stats()).unwrap();
        if stats.depth == 1 && stats.in_flight == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "never redelivered: {stats:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let received = rt
        .block_on(queue.receive(pgonce::ReceiveRequest::up_to(10)))
        .unwrap();
    let back: Vec<String> = received.iter().map(|m| m.id.clone()).collect();
    assert_eq!(back, held);
    let recorded: i64 = rt
        .block_on(
            sqlx::query_scalar("SELECT count(*) FROM incidents.observations").fetch_one(&pool),
        )
        .unwrap();
    assert_eq!(recorded, 0);
}

/// A webhook receiver that holds every request it gets unanswered (its
/// connection kept open) until [`HeldWebhook::answer_from_now`], then
/// answers 200: a receiver busy with a notification while its sender is
/// stopped. Written on a plain socket because the test kit's receiver
/// answers every request it keeps.
struct HeldWebhook {
    url: String,
    /// The idempotency key of each request, in arrival order.
    keys: std::sync::mpsc::Receiver<String>,
    answer: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl HeldWebhook {
    fn start() -> HeldWebhook {
        use std::io::{BufRead, Read, Write};
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let (sent, keys) = std::sync::mpsc::channel();
        let answer = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let answering = answer.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming().map_while(Result::ok) {
                let mut reader = std::io::BufReader::new(stream);
                let (mut key, mut length) = (String::new(), 0usize);
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    let (name, value) = line.split_once(':').unwrap_or((&line, ""));
                    match name.to_ascii_lowercase().as_str() {
                        "idempotency-key" => key = value.trim().to_owned(),
                        "content-length" => length = value.trim().parse().unwrap_or(0),
                        _ => {}
                    }
                }
                let mut body = vec![0; length];
                let _ = reader.read_exact(&mut body);
                if sent.send(key).is_err() {
                    return;
                }
                let mut stream = reader.into_inner();
                if answering.load(Ordering::SeqCst) {
                    let _ = stream.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                    );
                } else {
                    held.push(stream);
                }
            }
        });
        HeldWebhook { url, keys, answer }
    }

    /// Requests that come from now on are answered 200 at once.
    fn answer_from_now(&self) {
        self.answer.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The key of the next request; panics past `STUCK`.
    fn next_key(&self) -> String {
        self.keys
            .recv_timeout(STUCK)
            .expect("no webhook request came")
    }
}

/// Where the one notification job stands, and what the ledger holds.
#[derive(Debug, PartialEq, Eq, sqlx::FromRow)]
struct NotificationState {
    status: String,
    /// Its lease is still running.
    leased: bool,
    /// Rows in `incidents.notifications`.
    recorded: i64,
}

async fn notification_state(pool: &PgPool) -> NotificationState {
    sqlx::query_as(
        "SELECT j.status, coalesce(j.lease_expires_at > now(), false) AS leased, \
         (SELECT count(*) FROM incidents.notifications) AS recorded \
         FROM pgonce.jobs j WHERE j.kind = $1",
    )
    .bind(pgonce_incidents::service::NOTIFY_JOB_KIND)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A migrated database on which one observation waits that opens one
/// incident (one policy, one entity), so one notification.
fn one_incident_to_notify(rt: &tokio::runtime::Runtime, pool: &PgPool) {
    let (org, _key) = rt
        .block_on(store::create_organization(pool, "notified"))
        .unwrap();
    let rule = Rule {
        attribute: "cpu".into(),
        op: Op::Gt,
        value: 50.0,
    };
    rt.block_on(store::create_policy(
        pool,
        org.id,
        "cpu-one",
        Singleton::Always,
        &rule,
    ))
    .unwrap();
    let org = Org {
        id: org.id,
        entities: vec!["svc-0".into()],
    };
    let queue = rt
        .block_on(observations_queue(pool, Duration::from_secs(60), 50))
        .unwrap();
    // Observation 2: cpu 74, over the rule.
    let _ = rt.block_on(send(&queue, &org, 2, 1));
}

/// A fresh, migrated database with [`one_incident_to_notify`], and a
/// receiver that holds what it gets: what the notifier tests start from.
struct Notified {
    rt: tokio::runtime::Runtime,
    _db: pgonce_testkit::ScratchDatabase,
    pool: PgPool,
    url: String,
    webhook: HeldWebhook,
}

impl Notified {
    fn new() -> Notified {
        let (rt, db, url) = fresh_database_url();
        let pool = rt.block_on(db.pool(4)).unwrap();
        rt.block_on(pgonce_incidents::migrate(&pool)).unwrap();
        one_incident_to_notify(&rt, &pool);
        Notified {
            rt,
            _db: db,
            pool,
            url,
            webhook: HeldWebhook::start(),
        }
    }

    /// A worker's settings: its notifier posts to the receiver, each POST
    /// bounded by `timeout`, each claim by `lease`, failed sends retried
    /// within a fraction of a second.
    fn settings(&self, timeout: &str, lease: &str) -> Vec<(&'static str, String)> {
        vec![
            ("PGONCE_NOTIFIER__WEBHOOK_URL", self.webhook.url.clone()),
            ("PGONCE_NOTIFIER__TIMEOUT", timeout.into()),
            ("PGONCE_NOTIFIER__LEASE", lease.into()),
            ("PGONCE_NOTIFIER__RETRY__BASE", "100ms".into()),
            ("PGONCE_NOTIFIER__RETRY__MAX", "200ms".into()),
            ("PGONCE_PIPELINE__VISIBILITY_TIMEOUT", "60s".into()),
        ]
    }

    /// A worker with `settings`, once the receiver holds its POST; with
    /// its stderr and the POST's key.
    fn worker_posting(&self, settings: &[(&'static str, String)]) -> (Reaped, Stderr, String) {
        let settings: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut worker = one_worker(&self.url, &settings);
        let stderr = Stderr::of(&mut worker.0);
        let key = self.webhook.next_key();
        let payload: serde_json::Value = self
            .rt
            .block_on(
                sqlx::query_scalar("SELECT payload FROM pgonce.jobs WHERE kind = $1")
                    .bind(pgonce_incidents::service::NOTIFY_JOB_KIND)
                    .fetch_one(&self.pool),
            )
            .unwrap();
        let kept = pgonce_incidents::notifier::NotificationPayload::from_job(&payload).unwrap();
        assert!(kept.idempotency_key.is_some(), "{payload}");
        assert_eq!(key, kept.idempotency_key(), "the key its job keeps");
        (worker, stderr, key)
    }

    /// The notification whose key is `key` was left claimed by a worker
    /// stopped mid-POST (its log `seen`), nothing recorded; once its lease
    /// ends (ended here by moving its end to now, rather than waiting it
    /// out) another worker sends it once ([`sent_once_by_another_worker`]).
    fn left_claimed_then_sent_once(
        &self,
        settings: &[(&'static str, String)],
        key: &str,
        seen: &[String],
    ) {
        let held = self.rt.block_on(notification_state(&self.pool));
        assert_eq!(
            held,
            NotificationState {
                status: "processing".into(),
                leased: true,
                recorded: 0
            },
            "{}",
            seen.join("\n")
        );
        self.rt
            .block_on(
                sqlx::query("UPDATE pgonce.jobs SET lease_expires_at = now() WHERE kind = $1")
                    .bind(pgonce_incidents::service::NOTIFY_JOB_KIND)
                    .execute(&self.pool),
            )
            .unwrap();
        self.sent_once(settings, key);
    }

    /// See [`sent_once_by_another_worker`].
    fn sent_once(&self, settings: &[(&'static str, String)], key: &str) {
        let settings: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (*k, v.as_str())).collect();
        sent_once_by_another_worker(
            &self.rt,
            &self.pool,
            &self.url,
            &settings,
            &self.webhook,
            key,
        );
    }
}

/// The notification whose key is `key`, left unsent by a stopped worker,
/// is sent by another one (`settings`) to `webhook`, answering now: it
/// posts with the same key, and the job completes once, one row in the
/// ledger. Then that worker drains on SIGTERM and exits 0.
fn sent_once_by_another_worker(
    rt: &tokio::runtime::Runtime,
    pool: &PgPool,
    url: &str,
    settings: &[(&str, &str)],
    webhook: &HeldWebhook,
    key: &str,
) {
    webhook.answer_from_now();
    let mut second = one_worker(url, settings);
    assert_eq!(webhook.next_key(), key);
    let deadline = Instant::now() + STUCK;
    let done = loop {
        let state = rt.block_on(notification_state(pool));
        if state.status != "processing" && state.status != "pending" {
            break state;
        }
        assert!(Instant::now() < deadline, "never completed: {state:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        done,
        NotificationState {
            status: "completed".into(),
            leased: false,
            recorded: 1
        }
    );
    signal(&second.0, "TERM");
    assert!(second.0.wait().unwrap().success());
    // Every post carried the one key: the receiver drops all but the first.
    assert!(webhook.keys.try_iter().all(|k| k == key));
}

/// A second signal while a `pgonce worker`'s notifier is mid-POST (the
/// receiver holds the request) stops it at once: the job stays claimed,
/// nothing recorded. Once its lease ends (ended here by moving its end to
/// now, rather than waiting an hour) another worker's reaper offers it
/// again and its notifier sends it with the same idempotency key: the
/// receiver got the key twice, drops the second as a duplicate, and the
/// ledger holds one notification, the job completed once.
#[test]
fn a_second_signal_while_a_notification_is_posted_leaves_it_claimed_then_sent_once() {
    let notified = Notified::new();
    let settings = notified.settings("1h", "2h");
    let (mut first, stderr, key) = notified.worker_posting(&settings);
    let mut seen = Vec::new();
    signal(&first.0, "TERM");
    stderr.wait_for("shutting down", &mut seen);
    signal(&first.0, "INT");
    let status = first.0.wait().unwrap();
    seen.extend(stderr.0.iter());
    assert_eq!(status.code(), Some(130), "{status:?}:\n{}", seen.join("\n"));
    // The one line names what comes back, the notification too.
    let last = seen.last().map(String::as_str).unwrap_or_default();
    assert!(
        last.starts_with("pgonce: interrupted again (SIGINT) while stopping")
            && last.contains("claimed notifications sent again after their lease"),
        "{}",
        seen.join("\n")
    );
    notified.left_claimed_then_sent_once(&settings, &key, &seen);
}

/// SIGTERM while a `pgonce worker`'s notifier is mid-POST (the receiver
/// holds the request) drains it: the drain waits for the POST, which its
/// timeout ends, records the failed attempt (the job to be retried, why
/// kept, nothing in the ledger) and exits 0. Another worker then sends it once,
/// with the same idempotency key.
#[test]
fn sigterm_while_a_notification_is_posted_waits_for_it_then_it_is_sent_once() {
    let notified = Notified::new();
    let (rt, pool) = (&notified.rt, &notified.pool);
    let settings = notified.settings("3s", "1h");
    let (mut first, stderr, key) = notified.worker_posting(&settings);
    let mut seen = Vec::new();
    signal(&first.0, "TERM");
    stderr.wait_for("pgonce: stopped", &mut seen);
    let status = first.0.wait().unwrap();
    assert!(status.success(), "{status:?}:\n{}", seen.join("\n"));
    let last = seen.last().map(String::as_str).unwrap_or_default();
    assert!(last.contains("sent: 0, failed: 1"), "{}", seen.join("\n"));
    let failed = rt.block_on(notification_state(pool));
    assert_eq!(
        failed,
        NotificationState {
            status: "failed".into(),
            leased: false,
            recorded: 0
        },
        "{}",
        seen.join("\n")
    );
    // Why, as the job keeps it: the receiver got the request, and did not
    // answer in time; it was not unreachable.
    let why: String = rt
        .block_on(
            sqlx::query_scalar("SELECT last_error FROM pgonce.jobs WHERE kind = $1")
                .bind(pgonce_incidents::service::NOTIFY_JOB_KIND)
                .fetch_one(pool),
        )
        .unwrap();
    assert_eq!(why, "webhook did not answer within 3s");
    notified.sent_once(&settings, &key);
}

/// SIGTERM while a `pgonce worker`'s notifier is mid-POST that outlasts
/// `shutdown.timeout` (the receiver holds the request; the POST's own
/// timeout and the lease are hours): the drain gives up at the bound, exit
/// 1, its last line naming the notifier and what becomes of its claim. The
/// job stays claimed, nothing recorded; once its lease ends another worker
/// sends it once, with the same idempotency key.
#[test]
fn a_notification_posted_past_the_shutdown_timeout_is_abandoned_then_sent_once() {
    let notified = Notified::new();
    let mut settings = notified.settings("1h", "2h");
    settings.push(("PGONCE_PIPELINE__SHUTDOWN_DEADLINE", "1s".into()));
    settings.push(("PGONCE_SHUTDOWN__TIMEOUT", "7s".into()));
    let (mut first, stderr, key) = notified.worker_posting(&settings);
    let mut seen = Vec::new();
    signal(&first.0, "TERM");
    stderr.wait_for("shutting down", &mut seen);
    // Polled; the deadline only ends a run that never stops.
    let deadline = Instant::now() + STUCK;
    let status = loop {
        if let Some(status) = first.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "still draining:\n{}",
            seen.join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    seen.extend(stderr.0.iter());
    assert_eq!(status.code(), Some(1), "{status:?}:\n{}", seen.join("\n"));
    let last = seen.last().map(String::as_str).unwrap_or_default();
    assert_eq!(
        last,
        "pgonce: error: stopping took longer than shutdown.timeout (7s): stopped at once, \
         abandoning the notifier (its claimed notifications are sent again after their lease)",
        "{}",
        seen.join("\n")
    );
    notified.left_claimed_then_sent_once(&settings, &key, &seen);
}
