//! A reference model of the guarded write, checked step by step against
//! PostgreSQL.
//!
//! Three actors interleave decision reads ([`Guard::read`]) and writes of
//! three guarded sets (an entity's rows, each with a version): entities 0
//! and 1 share lock key 0, entity 2 has key 1. A write inserts a row or
//! bumps the version of the entity's first one, and is made one of five
//! ways: [`Guard::write`] (lock, re-read, compare, write, commit in one
//! call); [`Guard::begin_for`] or [`Guard::begin`] then
//! [`GuardedTransaction::check`](pgonce::GuardedTransaction::check) and the
//! write, the transaction left open until a later COMMIT, ROLLBACK or kill
//! (`pg_terminate_backend`), so a holder stays while others arrive; a
//! [`Guard::begin`] transaction switched to REPEATABLE READ before its
//! check (refused with `WrongIsolation`); and a writer holding the key with
//! [`pgonce::lock`] in a transaction of its own, which inserts without a
//! decision (the module docs allow such writers beside the guards). Some
//! writes use a guard with a short `lock_timeout`; actor C's session
//! inherits a short one of its own, which no guard's wait may take.
//!
//! Each case runs twice: with every key at READ COMMITTED, and with every
//! writer of key 0 at SERIALIZABLE (the module docs require all of a key's
//! writers to run so) beside key 1 at READ COMMITTED. The model knows the
//! lock queue of each key: a write whose key is held waits behind the
//! holder and every earlier waiter, and must be seen waiting (pg_locks,
//! `pg_blocking_pids`) for the sessions the model names before the next
//! step, and still so after every later step until the model releases it;
//! a bounded one fails with `LockTimeout` while the holder stays, its
//! connection clean. When a holder's transaction ends, the first waiter
//! takes the lock and finishes as the model says. Nothing sleeps.
//!
//! The oracle: every call's outcome (written, `Conflict` with the set the
//! re-read found, `LockTimeout`, `WrongIsolation`, a decision read's set);
//! after every step the table and the log of committed decisions equal the
//! model's, and no two committed guarded writes were decided on the same
//! state of a set (the states only grow, so a repeated one is a duplicate).
//! Under SERIALIZABLE the lock statement takes the transaction's snapshot
//! before its wait, so the re-read of a write that waited may be stale:
//! where a writer that read the set (a guarded one) changed it since, a
//! write whose stale re-read passed must fail with a serialization failure
//! (40001) by its COMMIT; where only writes without a read (under
//! `pgonce::lock`) changed it, PostgreSQL orders the guarded write before
//! them and it commits, as the module docs warn. PostgreSQL's predicate
//! locks are coarser than the sets, so any SERIALIZABLE step may also fail
//! so, and the model follows; never a READ COMMITTED one.
//!
//! `MODEL_TEST_CASES` sets the number of cases (default 16, after one
//! scripted case); see docs/testing.md.

mod support;

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use pgonce::guard::{Guard, GuardConfig, Isolation, ReadSet};
use pgonce::{Error, IsolationLevel, LockKey};
use pgonce_testkit::{Blocked, Interleaving, ScratchDatabase, Session, fresh_migrated_database};
use proptest::prelude::*;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

const ACTORS: usize = 3;
const NAMES: [&str; ACTORS] = ["A", "B", "C"];
const ENTITIES: usize = 3;
/// Each entity's lock key: entities 0 and 1 share key 0.
const KEY_OF: [usize; ENTITIES] = [0, 0, 1];
const KEYS: usize = 2;
/// A bounded guard's `lock_timeout`. Short: the model has such a guard
/// wait only for a holder that stays.
const BOUND: Duration = Duration::from_millis(20);
/// The actor whose session inherits a `lock_timeout` of its own.
const INHERITING: usize = 2;
/// The `lock_timeout` actor C's session inherits (as an operator's `ALTER
/// ROLE ... SET lock_timeout` gives every new one), which neither a guard
/// nor `pgonce::lock` applies to its lock: C's waits last as the model
/// says, like the others'.
const INHERITED_LOCK_TIMEOUT: &str = "10ms";

const SCHEMA: &str = "
CREATE TABLE public.things (
    entity  text   NOT NULL,
    id      bigint NOT NULL,
    version bigint NOT NULL,
    PRIMARY KEY (entity, id)
);
CREATE TABLE public.decisions (
    entity     text NOT NULL,
    decided_on text NOT NULL
);
";

/// What a write changes in its entity's set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// A new row, version 1.
    Insert,
    /// The version of the entity's first row (a new row if it has none).
    Bump,
}

/// How a write is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// `Guard::write`: lock, re-read, compare, write and commit in one call.
    Write,
    /// `Guard::begin_for` (BEGIN and the lock), check, write; left open.
    BeginFor,
    /// `Guard::begin`, then check (which takes the lock), write; left open.
    BeginThenCheck,
    /// `Guard::begin`, `SET TRANSACTION ISOLATION LEVEL REPEATABLE READ`,
    /// check: refused with `WrongIsolation` once the lock is granted.
    Switched,
    /// `pgonce::lock` in a transaction of the caller's own at the key's
    /// level, then an insert without a decision; left open.
    Lock,
}

#[derive(Debug, Clone)]
enum Op {
    /// A decision read of `entity` (while the actor has no transaction).
    Read {
        actor: usize,
        entity: usize,
    },
    /// A write of `entity` decided on the actor's last read of it (the
    /// empty set if it never read it); `bounded`: with a lock_timeout.
    Write {
        actor: usize,
        entity: usize,
        change: Change,
        way: Way,
        bounded: bool,
    },
    Commit(usize),
    Rollback(usize),
    /// Terminates the actor's backend, whatever it is doing.
    Kill(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let change = prop_oneof![Just(Change::Insert), Just(Change::Bump)];
    let way = prop_oneof![
        3 => Just(Way::Write),
        3 => Just(Way::BeginFor),
        2 => Just(Way::BeginThenCheck),
        1 => Just(Way::Switched),
        2 => Just(Way::Lock),
    ];
    prop_oneof![
        4 => (0..ACTORS, 0..ENTITIES).prop_map(|(actor, entity)| Op::Read { actor, entity }),
        7 => (0..ACTORS, 0..ENTITIES, change, way, proptest::bool::weighted(0.2)).prop_map(
            |(actor, entity, change, way, bounded)| Op::Write {
                actor,
                entity,
                change,
                way,
                bounded,
            }
        ),
        3 => (0..ACTORS).prop_map(Op::Commit),
        1 => (0..ACTORS).prop_map(Op::Rollback),
        2 => (0..ACTORS).prop_map(Op::Kill),
    ]
}

/// Which keys run SERIALIZABLE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Every writer at READ COMMITTED.
    ReadCommitted,
    /// Every writer of key 0 at SERIALIZABLE, of key 1 at READ COMMITTED.
    FirstKeySerializable,
}

impl Plan {
    const ALL: [Plan; 2] = [Plan::ReadCommitted, Plan::FirstKeySerializable];

    fn serializable(self, key: usize) -> bool {
        self == Plan::FirstKeySerializable && key == 0
    }
}

/// A set as the model has it: each row's id and version.
type Rows = BTreeMap<i64, i64>;

fn read_set(rows: &Rows) -> ReadSet {
    ReadSet::from_versions(rows.iter().map(|(&id, &v)| (id, v)))
}

/// The committed `rows` after `change` (`id` for a new row), made by a
/// transaction that reads `seen` (its snapshot's rows): a bump bumps the
/// first row it sees, an insert or a bump seeing no row inserts.
fn changed(rows: &Rows, seen: &Rows, change: Change, id: i64) -> Rows {
    let mut rows = rows.clone();
    match (change, seen.keys().next()) {
        (Change::Bump, Some(first)) => *rows.get_mut(first).unwrap() += 1,
        _ => {
            rows.insert(id, 1);
        }
    }
    rows
}

/// A write the model has started: waiting for its key, or granted it.
#[derive(Debug, Clone)]
struct Pending {
    entity: usize,
    change: Change,
    way: Way,
    /// The id of a row it inserts.
    id: i64,
    /// The decision's set.
    seen: Rows,
    /// SERIALIZABLE: the transaction's snapshot, taken when its first
    /// statement (the one that takes the lock) started.
    snapshot: Option<Snapshot>,
}

/// What a SERIALIZABLE transaction's snapshot holds.
#[derive(Debug, Clone)]
struct Snapshot {
    /// Every entity's committed rows.
    rows: Vec<Rows>,
    /// The commits it holds ([`Model::commits`]).
    commits: u64,
}

/// A transaction left open holding its key, its write made.
#[derive(Debug, Clone)]
struct Open {
    key: usize,
    entity: usize,
    /// The entity's rows once it commits.
    rows: Rows,
    /// The set its decision saw; none for a write under `pgonce::lock`.
    decided_on: Option<Rows>,
    serializable: bool,
    /// SERIALIZABLE, and its stale re-read missed a write of a writer
    /// that read the set: it must not commit.
    doomed: bool,
}

#[derive(Debug, Clone)]
enum Actor {
    Idle,
    Waiting(Pending),
    Open(Open),
}

/// What the model says becomes of a write once it holds its key.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    /// Written: committed (`Way::Write`) or left open.
    Written,
    /// `Conflict`, the re-read having found this set; rolled back.
    Conflict(Rows),
    /// `WrongIsolation`; rolled back.
    WrongIsolation,
}

#[derive(Debug, Clone)]
struct Prediction {
    outcome: Outcome,
    serializable: bool,
    /// A write whose stale re-read passed: a serialization failure by its
    /// COMMIT.
    doomed: bool,
    /// SERIALIZABLE, its re-read stale, the check passed.
    stale_passed: bool,
    /// The entity's rows once written.
    rows: Rows,
}

/// A committed guarded write: its entity and the set it was decided on.
#[derive(Debug)]
struct Decided {
    entity: usize,
    seen: Rows,
}

#[derive(Debug)]
struct Model {
    plan: Plan,
    committed: Vec<Rows>,
    decisions: Vec<Decided>,
    /// Commits of a change so far.
    commits: u64,
    /// Per entity, the commit (in [`Model::commits`]) of the last change
    /// made by a writer that read the set first (a guarded write).
    read_then_changed: Vec<u64>,
    actors: Vec<Actor>,
    queues: Vec<VecDeque<usize>>,
    /// Each actor's last decision read of each entity.
    seen: Vec<Vec<Rows>>,
}

impl Model {
    fn new(plan: Plan) -> Model {
        Model {
            plan,
            committed: vec![Rows::new(); ENTITIES],
            decisions: Vec::new(),
            commits: 0,
            read_then_changed: vec![0; ENTITIES],
            actors: vec![Actor::Idle; ACTORS],
            queues: vec![VecDeque::new(); KEYS],
            seen: vec![vec![Rows::new(); ENTITIES]; ACTORS],
        }
    }

    fn holder(&self, key: usize) -> Option<usize> {
        (0..ACTORS).find(|&a| matches!(&self.actors[a], Actor::Open(o) if o.key == key))
    }

    /// The sessions waiting actor `w` waits for: its key's holder and every
    /// waiter ahead of it.
    fn waits_for(&self, w: usize) -> Vec<usize> {
        let Actor::Waiting(p) = &self.actors[w] else {
            return Vec::new();
        };
        let key = KEY_OF[p.entity];
        self.holder(key)
            .into_iter()
            .chain(self.queues[key].iter().copied().take_while(|&o| o != w))
            .collect()
    }

    /// Idle actor `a` starts `p`: `None` if its key is held (it then waits,
    /// unless `bounded`), or what it meets holding the key.
    fn start(&mut self, a: usize, p: Pending, bounded: bool) -> Option<Prediction> {
        let key = KEY_OF[p.entity];
        if self.holder(key).is_some() {
            if !bounded {
                self.queues[key].push_back(a);
                self.actors[a] = Actor::Waiting(p);
            }
            return None;
        }
        Some(self.predict(&p))
    }

    /// What `p` meets once it holds its key.
    fn predict(&self, p: &Pending) -> Prediction {
        let serializable = p.snapshot.is_some();
        let now = &self.committed[p.entity];
        // READ COMMITTED: the re-read's snapshot is taken after the lock.
        let reread = p.snapshot.as_ref().map_or(now, |s| &s.rows[p.entity]);
        let (outcome, doomed) = match p.way {
            Way::Switched => (Outcome::WrongIsolation, false),
            // An insert reads nothing: a stale snapshot cannot mislead it.
            Way::Lock => (Outcome::Written, false),
            _ if *reread != p.seen => (Outcome::Conflict(reread.clone()), false),
            // A stale re-read that passed conflicts with the writes it
            // missed. PostgreSQL aborts the transaction if one of them was
            // made by a writer that read the set (the two conflicts form a
            // cycle); a write without a read (an insert under
            // `pgonce::lock`) conflicts one way only, and SERIALIZABLE
            // orders this write before it: it commits.
            _ => (
                Outcome::Written,
                p.snapshot
                    .as_ref()
                    .is_some_and(|s| self.read_then_changed[p.entity] > s.commits),
            ),
        };
        Prediction {
            stale_passed: outcome == Outcome::Written && p.way != Way::Lock && reread != now,
            outcome,
            serializable,
            doomed,
            rows: changed(now, reread, p.change, p.id),
        }
    }

    /// Actor `a`, holding the key for `p`, met `pred`; `aborted`: it failed
    /// with a serialization failure instead. Returns whether its
    /// transaction ended (the key is then free).
    fn settle(&mut self, a: usize, p: Pending, pred: Prediction, aborted: bool) -> bool {
        let key = KEY_OF[p.entity];
        self.actors[a] = Actor::Idle;
        if aborted || pred.outcome != Outcome::Written {
            return true;
        }
        let decided_on = (p.way != Way::Lock).then_some(p.seen);
        if p.way == Way::Write {
            self.commit(p.entity, pred.rows, decided_on);
            return true;
        }
        self.actors[a] = Actor::Open(Open {
            key,
            entity: p.entity,
            rows: pred.rows,
            decided_on,
            serializable: pred.serializable,
            doomed: pred.doomed,
        });
        false
    }

    fn commit(&mut self, entity: usize, rows: Rows, decided_on: Option<Rows>) {
        self.committed[entity] = rows;
        self.commits += 1;
        if let Some(seen) = decided_on {
            self.read_then_changed[entity] = self.commits;
            self.decisions.push(Decided { entity, seen });
        }
    }

    /// Ends `a`'s transaction, committed or not; returns the key it frees.
    fn end(&mut self, a: usize, commit: bool) -> Option<usize> {
        match std::mem::replace(&mut self.actors[a], Actor::Idle) {
            Actor::Idle => None,
            Actor::Waiting(p) => {
                self.queues[KEY_OF[p.entity]].retain(|&o| o != a);
                None
            }
            Actor::Open(o) => {
                if commit {
                    self.commit(o.entity, o.rows, o.decided_on);
                }
                Some(o.key)
            }
        }
    }
}

/// What a write's task hands back: its open transaction (for a way that
/// leaves it open, once written) and the outcome.
struct Done {
    tx: Option<Transaction<'static, Postgres>>,
    outcome: pgonce::Result<()>,
}

impl Done {
    fn failed(e: impl Into<Error>) -> Done {
        Done {
            tx: None,
            outcome: Err(e.into()),
        }
    }

    /// `tx` left open if `out` is `Ok`, else rolled back.
    async fn open_unless_failed(
        tx: Transaction<'static, Postgres>,
        out: pgonce::Result<()>,
    ) -> Done {
        match out {
            Ok(()) => Done {
                tx: Some(tx),
                outcome: Ok(()),
            },
            Err(e) => {
                let _ = tx.rollback().await;
                Done::failed(e)
            }
        }
    }
}

/// The set of `entity`: each row's id and version.
async fn versions(conn: &mut PgConnection, entity: &str) -> pgonce::Result<ReadSet> {
    #[derive(sqlx::FromRow)]
    struct Thing {
        id: i64,
        version: i64,
    }
    let rows: Vec<Thing> = sqlx::query_as("SELECT id, version FROM things WHERE entity = $1")
        .bind(entity)
        .fetch_all(conn)
        .await?;
    Ok(ReadSet::from_versions(
        rows.into_iter().map(|t| (t.id, t.version)),
    ))
}

/// Makes `change` to `entity` (`id` for a new row), and logs the set it
/// was decided on, if any, in the same transaction.
async fn write(
    conn: &mut PgConnection,
    entity: &str,
    change: Change,
    id: i64,
    decided_on: Option<&ReadSet>,
) -> pgonce::Result<()> {
    let sql = match change {
        Change::Insert => "INSERT INTO things (entity, id, version) VALUES ($1, $2, 1)",
        Change::Bump => {
            "WITH bumped AS (
                 UPDATE things SET version = version + 1
                 WHERE entity = $1
                   AND id = (SELECT min(id) FROM things WHERE entity = $1)
                 RETURNING id
             )
             INSERT INTO things (entity, id, version)
             SELECT $1, $2, 1 WHERE NOT EXISTS (SELECT FROM bumped)"
        }
    };
    sqlx::query(sql)
        .bind(entity)
        .bind(id)
        .execute(&mut *conn)
        .await?;
    if let Some(seen) = decided_on {
        sqlx::query("INSERT INTO decisions (entity, decided_on) VALUES ($1, $2)")
            .bind(entity)
            .bind(seen.to_string())
            .execute(conn)
            .await?;
    }
    Ok(())
}

/// One write, as its task runs it.
struct WriteCall {
    pool: &'static PgPool,
    guard: Guard,
    key: LockKey,
    entity: String,
    change: Change,
    way: Way,
    id: i64,
    seen: ReadSet,
}

impl WriteCall {
    async fn run(self) -> Done {
        let WriteCall {
            pool,
            guard,
            key,
            entity,
            change,
            way,
            id,
            seen,
        } = self;
        let reread = async |c: &mut PgConnection| versions(c, &entity).await;
        match way {
            Way::Write => Done {
                tx: None,
                outcome: guard
                    .write(pool, key, &seen, reread, async |c| {
                        write(c, &entity, change, id, Some(&seen)).await
                    })
                    .await,
            },
            Way::BeginFor | Way::BeginThenCheck | Way::Switched => {
                let opened = if way == Way::BeginFor {
                    guard.begin_for(pool, key).await
                } else {
                    guard.begin(pool).await
                };
                let mut tx = match opened {
                    Ok(tx) => tx,
                    Err(e) => return Done::failed(e),
                };
                let out = async {
                    if way == Way::Switched {
                        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                            .execute(&mut **tx)
                            .await?;
                    }
                    tx.check(key, &seen, reread).await?;
                    write(&mut tx, &entity, change, id, Some(&seen)).await
                }
                .await;
                Done::open_unless_failed(tx.into_inner(), out).await
            }
            Way::Lock => {
                let level = match guard.config().isolation {
                    Isolation::Serializable => IsolationLevel::Serializable,
                    _ => IsolationLevel::ReadCommitted,
                };
                let mut tx = match pgonce::begin(pool, level).await {
                    Ok(tx) => tx,
                    Err(e) => return Done::failed(e),
                };
                let out = async {
                    match guard.config().lock_timeout {
                        Some(t) => pgonce::lock::lock_timeout(&mut tx, key, t).await?,
                        None => pgonce::lock::lock(&mut tx, key).await?,
                    }
                    write(&mut tx, &entity, change, id, None).await
                }
                .await;
                Done::open_unless_failed(tx, out).await
            }
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    reads: u64,
    written: u64,
    committed_open: u64,
    rolled_back: u64,
    conflicts: u64,
    /// Conflicts of a write that waited for the key, with the set its
    /// holder changed.
    conflicts_after_a_wait: u64,
    waits: u64,
    queued_behind_a_waiter: u64,
    /// Waits for a holder that writes the other entity of the key.
    waits_on_another_entity: u64,
    lock_timeouts: u64,
    wrong_isolation: u64,
    /// Writes under `pgonce::lock` beside the guards.
    lock_module_writes: u64,
    /// Serialization failures of a write whose stale re-read passed.
    stale_serializable_refused: u64,
    /// Serialization failures the model allowed but did not require.
    other_serialization_failures: u64,
    /// SERIALIZABLE writes whose stale re-read passed and that went
    /// through: only writes without a read had changed the set.
    stale_passed_after_a_blind_write: u64,
    killed_holding: u64,
    killed_waiting: u64,
}

/// An actor as the driver has it.
struct Conn {
    session: Session,
    /// The session's pool, for the transactions that outlive a step.
    pool: &'static PgPool,
    /// The backend of its connection, as of its last write's start.
    pid: i32,
    tx: Option<Transaction<'static, Postgres>>,
    waiting: Option<Blocked<Done>>,
}

struct Run<'a> {
    race: Interleaving,
    checker: &'a PgPool,
    entities: Vec<String>,
    keys: Vec<LockKey>,
    conns: Vec<Conn>,
    model: Model,
    next_id: i64,
}

impl Run<'_> {
    fn guard(&self, key: usize, bounded: bool) -> Guard {
        let isolation = if self.model.plan.serializable(key) {
            Isolation::Serializable
        } else {
            Isolation::ReadCommitted
        };
        Guard::new(
            "things",
            GuardConfig {
                isolation,
                lock_timeout: bounded.then_some(BOUND),
            },
        )
        .unwrap()
    }

    async fn pid_of_idle(&self, a: usize) -> Result<i32, String> {
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(self.conns[a].pool)
            .await
            .map_err(|e| e.to_string())
    }

    async fn write(
        &mut self,
        a: usize,
        entity: usize,
        change: Change,
        way: Way,
        bounded: bool,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let key = KEY_OF[entity];
        // A write without a decision inserts: it reads nothing.
        let change = if way == Way::Lock {
            Change::Insert
        } else {
            change
        };
        self.conns[a].pid = self.pid_of_idle(a).await?;
        self.next_id += 1;
        let pending = Pending {
            entity,
            change,
            way,
            id: self.next_id,
            seen: self.model.seen[a][entity].clone(),
            snapshot: self.model.plan.serializable(key).then(|| Snapshot {
                rows: self.model.committed.clone(),
                commits: self.model.commits,
            }),
        };
        let call = WriteCall {
            pool: self.conns[a].pool,
            guard: self.guard(key, bounded),
            key: self.keys[key],
            entity: self.entities[entity].clone(),
            change,
            way,
            id: pending.id,
            seen: read_set(&pending.seen),
        };
        let holder = self.model.holder(key);
        let ahead = !self.model.queues[key].is_empty();
        let what = format!("{way:?} {change:?} {}", self.entities[entity]);
        if way == Way::Lock {
            tally.lock_module_writes += 1;
        }
        match self.model.start(a, pending.clone(), bounded) {
            Some(pred) => {
                let done = self
                    .race
                    .step(&self.conns[a].session, &what, call.run())
                    .await
                    .map_err(|e| e.to_string())?;
                self.conns[a].tx = done.tx;
                self.judge(a, pending, pred, done.outcome, false, tally)?;
            }
            None if bounded => {
                let session = &self.conns[a].session;
                let done = self
                    .race
                    .step(session, &what, call.run())
                    .await
                    .map_err(|e| e.to_string())?;
                match done.outcome {
                    Err(Error::LockTimeout { key: k, .. }) if k == self.keys[key] => {}
                    other => return Err(format!("{what}: {other:?}, model LockTimeout")),
                }
                if done.tx.is_some() {
                    return Err(format!("{what}: a transaction left open after LockTimeout"));
                }
                let left = self
                    .race
                    .step(session, "next use", support::leftovers(self.conns[a].pool))
                    .await
                    .map_err(|e| e.to_string())?;
                if left != support::Leftovers::NONE {
                    return Err(format!("{what}: after LockTimeout, {left:?}"));
                }
                let setting: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
                    .fetch_one(self.conns[a].pool)
                    .await
                    .map_err(|e| e.to_string())?;
                let own = if a == INHERITING {
                    INHERITED_LOCK_TIMEOUT
                } else {
                    "0"
                };
                if setting != own {
                    return Err(format!(
                        "{what}: after LockTimeout, lock_timeout {setting}, the session's {own}"
                    ));
                }
                tally.lock_timeouts += 1;
            }
            None => {
                tally.waits += 1;
                tally.queued_behind_a_waiter += u64::from(ahead);
                if let Some(h) = holder
                    && matches!(&self.model.actors[h], Actor::Open(o) if o.entity != entity)
                {
                    tally.waits_on_another_entity += 1;
                }
                let waiting = self
                    .race
                    .step_blocks(&self.conns[a].session, &what, call.run())
                    .await
                    .map_err(|e| e.to_string())?;
                let by = waiting.blocked_by().to_vec();
                self.conns[a].waiting = Some(waiting);
                self.blocked_as_modelled(a, &by)?;
            }
        }
        Ok(())
    }

    /// Actor `a`'s write, holding its key, returned `got`; the model said
    /// `pred`. Settles the model; returns whether the transaction ended.
    fn judge(
        &mut self,
        a: usize,
        p: Pending,
        pred: Prediction,
        got: pgonce::Result<()>,
        waited: bool,
        tally: &mut Tally,
    ) -> Result<bool, String> {
        let commits_now = p.way == Way::Write && pred.outcome == Outcome::Written;
        let aborted = match (&pred.outcome, got) {
            (_, Err(Error::SerializationFailure { .. })) if pred.serializable => {
                if pred.doomed {
                    tally.stale_serializable_refused += 1;
                } else {
                    tally.other_serialization_failures += 1;
                }
                true
            }
            (Outcome::Written, Ok(())) if pred.doomed && commits_now => {
                return Err(format!(
                    "{}: a stale SERIALIZABLE write committed, decided on {}",
                    NAMES[a],
                    read_set(&p.seen)
                ));
            }
            (Outcome::Written, Ok(())) => {
                tally.written += 1;
                tally.stale_passed_after_a_blind_write += u64::from(pred.stale_passed);
                false
            }
            (Outcome::Conflict(want), Err(Error::Conflict { found, .. })) => {
                if found != read_set(want) {
                    return Err(format!(
                        "{}: Conflict finding {found}, model {}",
                        NAMES[a],
                        read_set(want)
                    ));
                }
                tally.conflicts += 1;
                tally.conflicts_after_a_wait += u64::from(waited);
                false
            }
            (Outcome::WrongIsolation, Err(Error::WrongIsolation { .. })) => {
                tally.wrong_isolation += 1;
                false
            }
            (want, got) => {
                return Err(format!("{}: {got:?}, model {want:?}", NAMES[a]));
            }
        };
        let open = self.conns[a].tx.is_some();
        let ended = self.model.settle(a, p, pred, aborted);
        if open == ended {
            return Err(format!(
                "{}: transaction {}, model {}",
                NAMES[a],
                if open { "open" } else { "ended" },
                if ended { "ended" } else { "open" }
            ));
        }
        Ok(ended)
    }

    /// `freed`'s queue after its holder's transaction ended: each waiter in
    /// turn takes the key and finishes as the model says, until one keeps
    /// it open.
    async fn grant_next(&mut self, freed: Option<usize>, tally: &mut Tally) -> Result<(), String> {
        let Some(key) = freed else {
            return Ok(());
        };
        while let Some(w) = self.model.queues[key].pop_front() {
            let Actor::Waiting(p) = std::mem::replace(&mut self.model.actors[w], Actor::Idle)
            else {
                unreachable!("only a waiting actor is queued")
            };
            let pred = self.model.predict(&p);
            let waiting = self.conns[w].waiting.take().unwrap();
            let done = waiting.resume().await.map_err(|e| e.to_string())?;
            self.conns[w].tx = done.tx;
            let ended = self
                .judge(w, p, pred, done.outcome, true, tally)
                .map_err(|e| format!("released: {e}"))?;
            if !ended {
                break;
            }
        }
        Ok(())
    }

    /// Waiting actor `a` waits for sessions the model names.
    fn blocked_as_modelled(&self, a: usize, by: &[String]) -> Result<(), String> {
        let want: Vec<&str> = self.model.waits_for(a).iter().map(|&o| NAMES[o]).collect();
        if by.is_empty() || !by.iter().all(|b| want.contains(&b.as_str())) {
            return Err(format!(
                "{} waits for {by:?}, the model for {want:?}",
                NAMES[a]
            ));
        }
        Ok(())
    }
}

impl support::StepByStep for Run<'_> {
    type Op = Op;
    type Tally = Tally;

    async fn step(&mut self, op: &Op, tally: &mut Tally) -> Result<(), String> {
        match *op {
            Op::Read { actor: a, entity } => {
                if !matches!(self.model.actors[a], Actor::Idle) {
                    return Ok(());
                }
                let name = self.entities[entity].clone();
                let got = self
                    .race
                    .try_step(
                        &self.conns[a].session,
                        &format!("read {name}"),
                        self.guard(KEY_OF[entity], false)
                            .read(self.conns[a].pool, async |c| versions(c, &name).await),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                let want = &self.model.committed[entity];
                if got != read_set(want) {
                    return Err(format!("read {got}, model {}", read_set(want)));
                }
                self.model.seen[a][entity] = want.clone();
                tally.reads += 1;
            }
            Op::Write {
                actor: a,
                entity,
                change,
                way,
                bounded,
            } => {
                if !matches!(self.model.actors[a], Actor::Idle) {
                    return Ok(());
                }
                self.write(a, entity, change, way, bounded, tally).await?;
            }
            Op::Commit(a) | Op::Rollback(a) => {
                let Actor::Open(open) = self.model.actors[a].clone() else {
                    return Ok(());
                };
                let commit = matches!(op, Op::Commit(_));
                let c = &mut self.conns[a];
                let tx = c.tx.take().unwrap();
                let got: pgonce::Result<()> = if commit {
                    self.race.step(&c.session, "COMMIT", tx.commit()).await
                } else {
                    self.race.step(&c.session, "ROLLBACK", tx.rollback()).await
                }
                .map_err(|e| e.to_string())?
                .map_err(Error::from);
                let committed = match got {
                    Ok(()) if open.doomed && commit => {
                        return Err("a stale SERIALIZABLE write committed".into());
                    }
                    Ok(()) => commit,
                    Err(Error::SerializationFailure { .. }) if open.serializable => {
                        if open.doomed {
                            tally.stale_serializable_refused += 1;
                        } else {
                            tally.other_serialization_failures += 1;
                        }
                        false
                    }
                    Err(e) => return Err(format!("{op:?}: {e}")),
                };
                if committed {
                    tally.committed_open += 1;
                } else {
                    tally.rolled_back += 1;
                }
                let freed = self.model.end(a, committed);
                self.grant_next(freed, tally).await?;
            }
            Op::Kill(a) => {
                let holding = matches!(self.model.actors[a], Actor::Open(_));
                let pid = if matches!(self.model.actors[a], Actor::Idle) {
                    self.pid_of_idle(a).await?
                } else {
                    self.conns[a].pid
                };
                // Returns once the backend has exited, its locks released.
                let gone: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
                    .bind(pid)
                    .fetch_one(self.checker)
                    .await
                    .map_err(|e| e.to_string())?;
                if !gone {
                    return Err(format!("backend {pid} of {} did not exit", NAMES[a]));
                }
                let c = &mut self.conns[a];
                drop(c.tx.take());
                if let Some(waiting) = c.waiting.take() {
                    tally.killed_waiting += 1;
                    let done = waiting.resume().await.map_err(|e| e.to_string())?;
                    if matches!(
                        done.outcome,
                        Ok(())
                            | Err(Error::Conflict { .. }
                                | Error::LockTimeout { .. }
                                | Error::WrongIsolation { .. })
                    ) || done.tx.is_some()
                    {
                        return Err(format!(
                            "{}: a killed write returned {:?}",
                            NAMES[a], done.outcome
                        ));
                    }
                } else if holding {
                    tally.killed_holding += 1;
                }
                if a == INHERITING {
                    // On the connection that replaces the killed one.
                    self.conns[a]
                        .session
                        .set("lock_timeout", INHERITED_LOCK_TIMEOUT)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                let freed = self.model.end(a, false);
                self.grant_next(freed, tally).await?;
            }
        }
        Ok(())
    }

    /// Every actor the model has waiting is still seen waiting, for the
    /// sessions the model names; the table and the committed decisions are
    /// the model's; no two committed writes decided on one state of a set.
    async fn compare(&self) -> Result<(), String> {
        for (a, actor) in self.model.actors.iter().enumerate() {
            if matches!(actor, Actor::Waiting(_)) {
                let by = self
                    .race
                    .blockers_of(&self.conns[a].session)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("{} is not waiting", NAMES[a]))?;
                self.blocked_as_modelled(a, &by)?;
            }
        }
        #[derive(sqlx::FromRow)]
        struct Thing {
            entity: String,
            id: i64,
            version: i64,
        }
        let rows: Vec<Thing> =
            sqlx::query_as("SELECT entity, id, version FROM things WHERE entity = ANY($1)")
                .bind(&self.entities)
                .fetch_all(self.checker)
                .await
                .map_err(|e| e.to_string())?;
        let mut stored = vec![Rows::new(); ENTITIES];
        for Thing {
            entity,
            id,
            version,
        } in rows
        {
            let e = self.entities.iter().position(|n| *n == entity).unwrap();
            stored[e].insert(id, version);
        }
        if stored != self.model.committed {
            return Err(format!(
                "stored {stored:?}, model {:?}",
                self.model.committed
            ));
        }
        #[derive(sqlx::FromRow, Debug, PartialEq, Eq, PartialOrd, Ord)]
        struct Decision {
            entity: String,
            decided_on: String,
        }
        let mut stored: Vec<Decision> = sqlx::query_as(
            "SELECT entity, decided_on FROM decisions WHERE entity = ANY($1) \
             ORDER BY entity, decided_on",
        )
        .bind(&self.entities)
        .fetch_all(self.checker)
        .await
        .map_err(|e| e.to_string())?;
        if let Some(twice) = stored.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!(
                "two committed writes of {} decided on {}",
                twice[0].entity, twice[0].decided_on
            ));
        }
        // Sorted as Rust sorts, as the model's are.
        stored.sort();
        let mut want: Vec<Decision> = self
            .model
            .decisions
            .iter()
            .map(|d| Decision {
                entity: self.entities[d.entity].clone(),
                decided_on: read_set(&d.seen).to_string(),
            })
            .collect();
        want.sort();
        if stored != want {
            return Err(format!("decisions {stored:?}, model {want:?}"));
        }
        Ok(())
    }
}

/// Case `case`'s operations under `plan`, on sessions of their own;
/// every backend they leave is terminated, whatever the outcome.
async fn run(
    db: &ScratchDatabase,
    checker: &PgPool,
    case: u64,
    plan: Plan,
    ops: &[Op],
    tally: &mut Tally,
) -> Result<(), String> {
    let race = Interleaving::new(db.options())
        .await
        .map_err(|e| e.to_string())?;
    let mut conns = Vec::new();
    for name in NAMES {
        let session = race.session(name).await.map_err(|e| e.to_string())?;
        if name == NAMES[INHERITING] {
            session
                .set("lock_timeout", INHERITED_LOCK_TIMEOUT)
                .await
                .map_err(|e| e.to_string())?;
        }
        // A transaction a step leaves open borrows its pool for as long as
        // it lives; the pool is closed when the run ends.
        let pool: &'static PgPool = Box::leak(Box::new(session.pool().clone()));
        conns.push(Conn {
            session,
            pool,
            pid: 0,
            tx: None,
            waiting: None,
        });
    }
    let tag = format!("case-{case}:{plan:?}");
    let mut run = Run {
        race,
        checker,
        entities: (0..ENTITIES).map(|e| format!("{tag}:{e}")).collect(),
        keys: (0..KEYS)
            .map(|k| LockKey::new("guard-model", &format!("{tag}:{k}")).unwrap())
            .collect(),
        conns,
        model: Model::new(plan),
        next_id: 0,
    };
    let outcome = support::steps_until_divergence(&mut run, &format!("{plan:?}"), ops, tally).await;
    for c in &mut run.conns {
        support::end_with_backend(checker, c.pid, c.tx.take(), c.waiting.take()).await;
        c.pool.close().await;
    }
    outcome.map_err(|e| format!("{e}\nmodel: {:?}", run.model))
}

/// A case that reaches every path the assertion at the end of the test
/// names, however few random cases a run has.
fn scripted_case() -> Vec<Op> {
    let write = |actor, entity, change, way, bounded| Op::Write {
        actor,
        entity,
        change,
        way,
        bounded,
    };
    use {Change::*, Way::*};
    vec![
        Op::Read {
            actor: 0,
            entity: 0,
        },
        Op::Read {
            actor: 1,
            entity: 0,
        },
        // B holds key 0, its insert uncommitted.
        write(1, 0, Insert, BeginFor, false),
        // A, decided on the same state, waits: after B's commit, a
        // conflict (READ COMMITTED) or a serialization failure.
        write(0, 0, Insert, Write, false),
        write(2, 1, Insert, Write, true),
        // C waits behind A, for B, which writes the other entity.
        write(2, 1, Bump, BeginThenCheck, false),
        Op::Commit(1),
        Op::Kill(2),
        write(0, 2, Insert, Lock, false),
        write(1, 2, Insert, Switched, false),
        write(2, 2, Bump, BeginFor, false),
        Op::Kill(2),
        Op::Rollback(0),
        Op::Read {
            actor: 0,
            entity: 0,
        },
        write(0, 0, Bump, Write, false),
        Op::Read {
            actor: 0,
            entity: 0,
        },
        // B holds key 0, having inserted without a read; A waits: at READ
        // COMMITTED a conflict; under SERIALIZABLE its stale re-read
        // passes, and it commits.
        write(1, 0, Insert, Lock, false),
        write(0, 0, Bump, BeginFor, false),
        Op::Commit(1),
        Op::Commit(0),
    ]
}

#[test]
fn guarded_writes_follow_the_reference_model_step_by_step() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (db, checker) = rt.block_on(async {
        let (db, pool) = fresh_migrated_database(2, pgonce::migrate).await;
        sqlx::raw_sql(SCHEMA).execute(&pool).await.unwrap();
        (db, pool)
    });
    let mut scripted = Tally::default();
    rt.block_on(async {
        for plan in Plan::ALL {
            if let Err(e) = run(
                &db,
                &checker,
                u64::MAX,
                plan,
                &scripted_case(),
                &mut scripted,
            )
            .await
            {
                panic!("the scripted case: {e}");
            }
        }
    });
    let tally = support::check_model(
        file!(),
        16,
        proptest::collection::vec(op(), 1..60),
        scripted,
        |case, ops, tally| {
            rt.block_on(async {
                for plan in Plan::ALL {
                    run(&db, &checker, case, plan, ops, tally).await?;
                }
                Ok(())
            })
        },
    );
    assert!(
        tally.written > 0
            && tally.committed_open > 0
            && tally.rolled_back > 0
            && tally.conflicts_after_a_wait > 0
            && tally.queued_behind_a_waiter > 0
            && tally.waits_on_another_entity > 0
            && tally.lock_timeouts > 0
            && tally.wrong_isolation > 0
            && tally.lock_module_writes > 0
            && tally.stale_serializable_refused > 0
            && tally.stale_passed_after_a_blind_write > 0
            && tally.killed_holding > 0
            && tally.killed_waiting > 0,
        "the run reached writes (committed at once and left open, then committed or \
         rolled back), conflicts after a wait, waits behind a waiter and for the other \
         entity of a key, lock timeouts, WrongIsolation, writes under pgonce::lock, stale \
         SERIALIZABLE writes refused, and let through after a write without a read, and \
         kills holding and waiting: {tally:?}"
    );
}
