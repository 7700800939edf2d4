//! A reference model of per-scope gapless sequences, checked step by step
//! against PostgreSQL, under every strategy.
//!
//! Three connections run random interleavings of BEGIN, taking the next
//! number of one of two scopes (and inserting the row that carries it),
//! COMMIT, ROLLBACK, and a connection killed (`pg_terminate_backend`)
//! idle, in a transaction, or while it waits for a lock. The model knows
//! what each strategy locks, so before every take it says whether the take
//! returns at once (and which number) or waits, and for whom:
//!
//! * the advisory lock and the counter row serialize one scope, the table
//!   lock every scope; a second waiter queues behind the first (PostgreSQL's
//!   lock queues and a locked row's waiters are first come, first served,
//!   and select-for-update locks a scope's rows in number order, so every
//!   taker waits at the same first row);
//! * `SELECT ... FOR UPDATE` locks only the scope's committed rows: in an
//!   empty scope nothing, so a second taker computes the same number and
//!   its INSERT waits on the first's uncommitted index entry, then fails
//!   with `NumberTaken` if the first commits, or goes on if it rolls back;
//! * under the counter row, a scope's first counter row is an uncommitted
//!   insert, which a second taker waits for the same way.
//!
//! A take the model says waits is started and the driver goes on only once
//! PostgreSQL shows its backend waiting on the sessions the model names
//! (pg_locks, `pg_blocking_pids`); when a transaction ends, each waiter the
//! model releases must finish with the model's number (or error), and the
//! others stay waiting. Nothing sleeps: a kill waits for the backend to
//! exit (`pg_terminate_backend` with a timeout). After every step the
//! committed numbers of each scope must be the model's, and the model's
//! are 1..n: unique, gapless, a rolled-back or killed number handed out
//! again.
//!
//! Takes whose outcome PostgreSQL leaves to chance are not made: one that
//! would close a wait-for cycle (the deadlock detector picks its victim by
//! timing), a second waiter on one uncommitted index entry (when it ends,
//! both wake at once and either may win), and a second waiter on a counter
//! row (its holder's update makes a new version of the row, and the waiters
//! for the old one race for it: seen once, when the first waiter was still
//! waiting after the holder's COMMIT).
//!
//! The interleaving is the case's operations, replayed the same way every
//! time: a failing case is shrunk, printed and its seed persisted in
//! `tests/sequence_model.proptest-regressions`, so the next run replays it
//! first. `MODEL_TEST_CASES` sets the number of cases (default 16);
//! see docs/testing.md.

mod support;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use pgonce::{Error, NumberedTable, Sequence, SequenceConfig, SequenceStrategy as Numbering};
use pgonce_testkit::{Blocked, Interleaving, ScratchDatabase, Session, fresh_migrated_database};
use proptest::prelude::*;
use sqlx::{PgPool, Postgres, Transaction};

const SESSIONS: usize = 3;
const SCOPES: u8 = 2;
const NAMES: [&str; SESSIONS] = ["A", "B", "C"];

const SCHEMA: &str = "
CREATE TABLE public.incidents (
    org    text   NOT NULL,
    number bigint NOT NULL,
    UNIQUE (org, number)
);
";

#[derive(Debug, Clone)]
enum Op {
    Begin(usize),
    /// Takes the next number of `scope` and inserts its row (after a
    /// BEGIN, if the session has no transaction).
    Take {
        session: usize,
        scope: u8,
    },
    Commit(usize),
    Rollback(usize),
    /// Terminates the session's backend, whatever it is doing.
    Kill(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0..SESSIONS).prop_map(Op::Begin),
        6 => (0..SESSIONS, 0..SCOPES).prop_map(|(session, scope)| Op::Take { session, scope }),
        2 => (0..SESSIONS).prop_map(Op::Commit),
        1 => (0..SESSIONS).prop_map(Op::Rollback),
        2 => (0..SESSIONS).prop_map(Op::Kill),
    ]
}

/// What a strategy locks to serialize a take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Lock {
    /// The scope: its advisory lock, or its counter row.
    Scope(u8),
    /// The whole table (`LOCK TABLE ... IN EXCLUSIVE MODE`).
    Table,
    /// The scope's committed rows (`SELECT ... FOR UPDATE`).
    Rows(u8),
}

/// How a take waits.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Wait {
    /// In `Lock`'s queue, behind its holder and every earlier waiter.
    Queue(Lock),
    /// For the end of `holder`'s transaction, on its uncommitted index
    /// entry: the scope's first counter row (`number` not yet known), or the
    /// numbered row (`number` computed, its INSERT waiting).
    Entry { holder: usize, number: Option<i64> },
}

/// A transaction as the model has it: what it took, what it holds.
#[derive(Debug, Clone, Default)]
struct Tx {
    taken: Vec<(u8, i64)>,
    locks: BTreeSet<Lock>,
}

#[derive(Debug, Clone)]
enum State {
    Idle,
    Open(Tx),
    Blocked { tx: Tx, scope: u8, wait: Wait },
}

/// What the model says becomes of a take, or of a waiting take once what
/// it waited for ended.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Outcome {
    Takes(i64),
    /// Waits, for the sessions `waits_for` names.
    Waits,
    /// `NumberTaken`, its transaction rolled back.
    Taken,
}

#[derive(Debug)]
struct Model {
    strategy: Numbering,
    committed: BTreeMap<u8, Vec<i64>>,
    sessions: Vec<State>,
    queues: BTreeMap<Lock, VecDeque<usize>>,
}

impl Model {
    fn new(strategy: Numbering) -> Model {
        Model {
            strategy,
            committed: (0..SCOPES).map(|k| (k, Vec::new())).collect(),
            sessions: vec![State::Idle; SESSIONS],
            queues: BTreeMap::new(),
        }
    }

    fn tx(&self, s: usize) -> Option<&Tx> {
        match &self.sessions[s] {
            State::Idle => None,
            State::Open(tx) | State::Blocked { tx, .. } => Some(tx),
        }
    }

    fn lock_for(&self, scope: u8) -> Option<Lock> {
        match self.strategy {
            Numbering::TableLock => Some(Lock::Table),
            Numbering::SelectForUpdate => {
                (!self.committed[&scope].is_empty()).then_some(Lock::Rows(scope))
            }
            _ => Some(Lock::Scope(scope)),
        }
    }

    fn holder(&self, lock: Lock) -> Option<usize> {
        (0..SESSIONS).find(|&s| self.tx(s).is_some_and(|tx| tx.locks.contains(&lock)))
    }

    /// Who holds `number` of `scope` uncommitted, other than `s`.
    fn entry_holder(&self, s: usize, scope: u8, number: i64) -> Option<usize> {
        (0..SESSIONS).filter(|&o| o != s).find(|&o| {
            self.tx(o)
                .is_some_and(|tx| tx.taken.contains(&(scope, number)))
        })
    }

    /// One past the greatest number `s` sees: the committed ones and its own.
    fn next_number(&self, s: usize, scope: u8) -> i64 {
        let own = self.tx(s).into_iter().flat_map(|tx| &tx.taken);
        self.committed[&scope]
            .iter()
            .chain(own.filter(|(k, _)| *k == scope).map(|(_, n)| n))
            .max()
            .map_or(1, |n| n + 1)
    }

    /// What a take of `scope` by `s` meets now: a number and the lock it
    /// takes, or a wait (and the lock taken before it).
    fn attempt(&self, s: usize, scope: u8) -> (Result<i64, Wait>, Option<Lock>) {
        let lock = self.lock_for(scope);
        if let Some(l) = lock
            && let Some(h) = self.holder(l).filter(|&h| h != s)
        {
            let wait =
                if self.strategy == Numbering::CounterRow && self.committed[&scope].is_empty() {
                    Wait::Entry {
                        holder: h,
                        number: None,
                    }
                } else {
                    Wait::Queue(l)
                };
            return (Err(wait), None);
        }
        let n = self.next_number(s, scope);
        if self.strategy == Numbering::SelectForUpdate
            && let Some(h) = self.entry_holder(s, scope, n)
        {
            let wait = Wait::Entry {
                holder: h,
                number: Some(n),
            };
            return (Err(wait), lock);
        }
        (Ok(n), lock)
    }

    /// The sessions `wait` (of session `w`) waits for: a queue's holder and
    /// everyone ahead, or an entry's holder.
    fn targets(&self, w: usize, wait: Wait) -> Vec<usize> {
        match wait {
            Wait::Queue(l) => self
                .holder(l)
                .into_iter()
                .chain(
                    self.queues
                        .get(&l)
                        .into_iter()
                        .flat_map(|q| q.iter().copied().take_while(|&o| o != w)),
                )
                .collect(),
            Wait::Entry { holder, .. } => vec![holder],
        }
    }

    fn waits_for(&self, w: usize) -> Vec<usize> {
        match &self.sessions[w] {
            State::Blocked { wait, .. } => self.targets(w, *wait),
            _ => Vec::new(),
        }
    }

    /// Why a take of `scope` by open session `s` is not made, if it is
    /// not: its outcome would be PostgreSQL's choice.
    fn left_to_chance(&self, s: usize, scope: u8) -> Option<&'static str> {
        let (Err(wait), _) = self.attempt(s, scope) else {
            return None;
        };
        match wait {
            Wait::Entry { holder, .. } => {
                let herd = (0..SESSIONS).any(|o| {
                    matches!(self.sessions[o], State::Blocked { wait: Wait::Entry { holder: h, .. }, .. } if h == holder)
                });
                if herd {
                    return Some("a second waiter on one entry");
                }
            }
            // The holder's update makes a new version of the row; every
            // waiter for the old one then races for the new one.
            Wait::Queue(l @ Lock::Scope(_)) if self.strategy == Numbering::CounterRow => {
                if self.queues.get(&l).is_some_and(|q| !q.is_empty()) {
                    return Some("a second waiter on a counter row");
                }
            }
            Wait::Queue(_) => {}
        }
        let mut seen = BTreeSet::new();
        let mut next = self.targets(s, wait);
        while let Some(o) = next.pop() {
            if o == s {
                return Some("a deadlock");
            }
            if seen.insert(o) {
                next.extend(self.waits_for(o));
            }
        }
        None
    }

    /// Runs `s`'s take of `scope` (open, or granted what it waited for).
    fn take(&mut self, s: usize, scope: u8) -> Outcome {
        let (out, lock) = self.attempt(s, scope);
        let mut tx = match std::mem::replace(&mut self.sessions[s], State::Idle) {
            State::Open(tx) | State::Blocked { tx, .. } => tx,
            State::Idle => unreachable!("a take outside a transaction"),
        };
        tx.locks.extend(lock);
        match out {
            Ok(n) => {
                tx.taken.push((scope, n));
                self.sessions[s] = State::Open(tx);
                Outcome::Takes(n)
            }
            Err(wait) => {
                if let Wait::Queue(l) = wait {
                    self.queues.entry(l).or_default().push_back(s);
                }
                self.sessions[s] = State::Blocked { tx, scope, wait };
                Outcome::Waits
            }
        }
    }

    /// Ends `s`'s transaction (committed or not); returns what becomes of
    /// each waiter this releases, in order.
    fn end(&mut self, s: usize, commit: bool) -> Vec<(usize, Outcome)> {
        let tx = match std::mem::replace(&mut self.sessions[s], State::Idle) {
            State::Idle => return Vec::new(),
            State::Open(tx) => tx,
            State::Blocked { tx, wait, .. } => {
                if let Wait::Queue(l) = wait {
                    self.queues.get_mut(&l).unwrap().retain(|&o| o != s);
                }
                tx
            }
        };
        if commit {
            for (k, n) in &tx.taken {
                self.committed.get_mut(k).unwrap().push(*n);
            }
            self.committed.values_mut().for_each(|ns| ns.sort());
        }
        let mut out = Vec::new();
        for l in &tx.locks {
            if let Some(w) = self.queues.get_mut(l).and_then(VecDeque::pop_front) {
                out.push((w, self.resume(w)));
            }
        }
        for w in 0..SESSIONS {
            let State::Blocked {
                wait: Wait::Entry { holder, number },
                scope,
                ..
            } = self.sessions[w].clone()
            else {
                continue;
            };
            if holder != s {
                continue;
            }
            match number {
                // The first counter row is committed or gone: upsert again.
                None => out.push((w, self.resume(w))),
                // The number is committed: the INSERT fails, and rolls back.
                Some(_) if commit => {
                    out.push((w, Outcome::Taken));
                    out.extend(self.end(w, false));
                }
                // The entry is gone: the INSERT goes in.
                Some(n) => {
                    let State::Blocked { mut tx, .. } =
                        std::mem::replace(&mut self.sessions[w], State::Idle)
                    else {
                        unreachable!()
                    };
                    tx.taken.push((scope, n));
                    self.sessions[w] = State::Open(tx);
                    out.push((w, Outcome::Takes(n)));
                }
            }
        }
        out
    }

    fn resume(&mut self, w: usize) -> Outcome {
        let State::Blocked { scope, .. } = self.sessions[w] else {
            unreachable!("only a waiting take resumes")
        };
        self.take(w, scope)
    }
}

/// What a take's task hands back: its transaction (none once rolled back
/// after an error) and the number.
type TakeDone = (Option<Transaction<'static, Postgres>>, pgonce::Result<i64>);

/// A session as the driver has it.
struct Conn {
    session: Session,
    /// The backend of the open transaction.
    pid: i32,
    tx: Option<Transaction<'static, Postgres>>,
    waiting: Option<Blocked<TakeDone>>,
}

/// Takes the next number of `scope` and inserts its row; on an error,
/// rolls the transaction back (as `commit_numbered` does).
async fn take(seq: Sequence, mut tx: Transaction<'static, Postgres>, scope: String) -> TakeDone {
    let out = async {
        let number = seq.next(&mut tx, &scope).await?.number;
        sqlx::query("INSERT INTO incidents (org, number) VALUES ($1, $2)")
            .bind(&scope)
            .bind(number)
            .execute(&mut *tx)
            .await
            .map_err(|e| seq.number_taken(e.into(), &scope, number))?;
        Ok(number)
    }
    .await;
    match out {
        Ok(n) => (Some(tx), Ok(n)),
        Err(e) => {
            let _ = tx.rollback().await;
            (None, Err(e))
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    waited: u64,
    queued_behind_a_waiter: u64,
    entry_waits: u64,
    number_taken: u64,
    reused: u64,
    killed_in_tx: u64,
    killed_waiting: u64,
    left_to_chance: u64,
}

struct Run<'a> {
    race: Interleaving,
    checker: &'a PgPool,
    seq: Sequence,
    scopes: Vec<String>,
    conns: Vec<Conn>,
    model: Model,
    /// The greatest number handed out per scope, to count reuses.
    handed_out: BTreeMap<u8, i64>,
}

impl Run<'_> {
    /// BEGIN in idle session `s`.
    async fn begin(&mut self, s: usize) -> Result<(), String> {
        let c = &mut self.conns[s];
        let (tx, pid) = support::begin_noting_pid(&self.race, &c.session).await?;
        c.pid = pid;
        c.tx = Some(tx);
        self.model.sessions[s] = State::Open(Tx::default());
        Ok(())
    }

    /// A take's number against the model's; counts a number handed out
    /// before (and rolled back since) handed out again.
    fn took(
        &mut self,
        scope: u8,
        want: i64,
        got: pgonce::Result<i64>,
        tally: &mut Tally,
    ) -> Result<(), String> {
        match got {
            Ok(n) if n == want => {
                let most = self.handed_out.entry(scope).or_default();
                if n <= *most {
                    tally.reused += 1;
                }
                *most = (*most).max(n);
                Ok(())
            }
            got => Err(format!("took {got:?}, model {want}")),
        }
    }

    /// The waiting session `s` waits for sessions the model names.
    fn blocked_as_modelled(&self, s: usize, by: &[String]) -> Result<(), String> {
        let want: BTreeSet<&str> = self.model.waits_for(s).iter().map(|&o| NAMES[o]).collect();
        if by.is_empty() || !by.iter().all(|b| want.contains(b.as_str())) {
            return Err(format!(
                "{} waits for {by:?}, the model for {want:?}",
                NAMES[s]
            ));
        }
        Ok(())
    }

    /// The waiters a transaction's end released, against the model.
    async fn released(
        &mut self,
        released: Vec<(usize, Outcome)>,
        tally: &mut Tally,
    ) -> Result<(), String> {
        // A waiter released twice over (waits again, then is released by
        // a rollback the first release caused) ends as the last says.
        let mut last: BTreeMap<usize, Outcome> = BTreeMap::new();
        let mut order = Vec::new();
        for (w, outcome) in released {
            if last.insert(w, outcome).is_none() {
                order.push(w);
            }
        }
        for w in order {
            let outcome = last[&w];
            if outcome == Outcome::Waits {
                let by = self
                    .race
                    .wait_until_blocked(&self.conns[w].session, "waits again")
                    .await
                    .map_err(|e| e.to_string())?;
                self.blocked_as_modelled(w, &by)?;
                continue;
            }
            let waiting = self.conns[w].waiting.take().unwrap();
            let (tx, got) = waiting.resume().await.map_err(|e| e.to_string())?;
            self.conns[w].tx = tx;
            match outcome {
                Outcome::Takes(n) => {
                    let scope = self.model.tx(w).unwrap().taken.last().unwrap().0;
                    self.took(scope, n, got, tally)
                        .map_err(|e| format!("{} released: {e}", NAMES[w]))?;
                }
                Outcome::Taken => {
                    if !matches!(got, Err(Error::NumberTaken { .. })) {
                        return Err(format!("{} released: {got:?}, model NumberTaken", NAMES[w]));
                    }
                    tally.number_taken += 1;
                }
                Outcome::Waits => unreachable!(),
            }
        }
        Ok(())
    }
}

impl support::StepByStep for Run<'_> {
    type Op = Op;
    type Tally = Tally;

    async fn step(&mut self, op: &Op, tally: &mut Tally) -> Result<(), String> {
        match *op {
            Op::Begin(s) => {
                if matches!(self.model.sessions[s], State::Idle) {
                    self.begin(s).await?;
                }
            }
            Op::Take { session: s, scope } => {
                if matches!(self.model.sessions[s], State::Idle) {
                    self.begin(s).await?;
                }
                if !matches!(self.model.sessions[s], State::Open(_)) {
                    return Ok(());
                }
                if self.model.left_to_chance(s, scope).is_some() {
                    tally.left_to_chance += 1;
                    return Ok(());
                }
                let ahead = self
                    .model
                    .lock_for(scope)
                    .and_then(|l| self.model.queues.get(&l))
                    .is_some_and(|q| !q.is_empty());
                let outcome = self.model.take(s, scope);
                let c = &mut self.conns[s];
                let task = take(
                    self.seq.clone(),
                    c.tx.take().unwrap(),
                    self.scopes[scope as usize].clone(),
                );
                let what = format!("take {}", self.scopes[scope as usize]);
                match outcome {
                    Outcome::Takes(n) => {
                        let (tx, got) = self
                            .race
                            .step(&c.session, &what, task)
                            .await
                            .map_err(|e| e.to_string())?;
                        c.tx = tx;
                        self.took(scope, n, got, tally)?;
                    }
                    Outcome::Waits => {
                        tally.waited += 1;
                        tally.queued_behind_a_waiter += u64::from(ahead);
                        if matches!(
                            self.model.sessions[s],
                            State::Blocked {
                                wait: Wait::Entry { .. },
                                ..
                            }
                        ) {
                            tally.entry_waits += 1;
                        }
                        let waiting = self
                            .race
                            .step_blocks(&c.session, &what, task)
                            .await
                            .map_err(|e| e.to_string())?;
                        let by = waiting.blocked_by().to_vec();
                        self.conns[s].waiting = Some(waiting);
                        self.blocked_as_modelled(s, &by)?;
                    }
                    Outcome::Taken => unreachable!("a fresh take either takes or waits"),
                }
            }
            Op::Commit(s) | Op::Rollback(s) => {
                if !matches!(self.model.sessions[s], State::Open(_)) {
                    return Ok(());
                }
                let commit = matches!(op, Op::Commit(_));
                let c = &mut self.conns[s];
                let tx = c.tx.take().unwrap();
                if commit {
                    self.race.try_step(&c.session, "COMMIT", tx.commit()).await
                } else {
                    self.race
                        .try_step(&c.session, "ROLLBACK", tx.rollback())
                        .await
                }
                .map_err(|e| e.to_string())?;
                let released = self.model.end(s, commit);
                self.released(released, tally).await?;
            }
            Op::Kill(s) => {
                let c = &mut self.conns[s];
                let in_tx = !matches!(self.model.sessions[s], State::Idle);
                let pid = if in_tx {
                    c.pid
                } else {
                    sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(c.session.pool())
                        .await
                        .map_err(|e| e.to_string())?
                };
                // Returns once the backend has exited, its locks released.
                let gone: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
                    .bind(pid)
                    .fetch_one(self.checker)
                    .await
                    .map_err(|e| e.to_string())?;
                if !gone {
                    return Err(format!("backend {pid} of {} did not exit", NAMES[s]));
                }
                drop(c.tx.take());
                if let Some(waiting) = c.waiting.take() {
                    tally.killed_waiting += 1;
                    let (_, out) = waiting.resume().await.map_err(|e| e.to_string())?;
                    if out.is_ok() {
                        return Err(format!("{}: a killed take returned {out:?}", NAMES[s]));
                    }
                } else if in_tx {
                    tally.killed_in_tx += 1;
                }
                let released = self.model.end(s, false);
                self.released(released, tally).await?;
            }
        }
        Ok(())
    }

    /// The committed numbers of every scope are the model's, and 1..n.
    async fn compare(&self) -> Result<(), String> {
        #[derive(sqlx::FromRow)]
        struct Numbered {
            org: String,
            number: i64,
        }
        let rows: Vec<Numbered> = sqlx::query_as(
            "SELECT org, number FROM incidents WHERE org = ANY($1) ORDER BY org, number",
        )
        .bind(&self.scopes)
        .fetch_all(self.checker)
        .await
        .map_err(|e| e.to_string())?;
        let mut stored: BTreeMap<u8, Vec<i64>> = (0..SCOPES).map(|k| (k, Vec::new())).collect();
        for Numbered { org, number } in rows {
            let k = self.scopes.iter().position(|s| *s == org).unwrap() as u8;
            stored.get_mut(&k).unwrap().push(number);
        }
        if stored != self.model.committed {
            return Err(format!(
                "committed {stored:?}, model {:?}",
                self.model.committed
            ));
        }
        for (k, ns) in &stored {
            if *ns != (1..=ns.len() as i64).collect::<Vec<_>>() {
                return Err(format!("scope {k}: {ns:?} is not 1..n"));
            }
        }
        Ok(())
    }
}

/// Case `case`'s operations under `strategy`, on sessions of their own;
/// every backend they leave is terminated, whatever the outcome.
async fn run(
    db: &ScratchDatabase,
    checker: &PgPool,
    case: u64,
    strategy: Numbering,
    ops: &[Op],
    tally: &mut Tally,
) -> Result<(), String> {
    let race = Interleaving::new(db.options())
        .await
        .map_err(|e| e.to_string())?;
    let mut conns = Vec::new();
    for name in NAMES {
        conns.push(Conn {
            session: race.session(name).await.map_err(|e| e.to_string())?,
            pid: 0,
            tx: None,
            waiting: None,
        });
    }
    let mut run = Run {
        race,
        checker,
        seq: Sequence::new(
            NumberedTable::new("public.incidents", "org", "number").unwrap(),
            SequenceConfig { strategy },
        )
        .unwrap(),
        scopes: (0..SCOPES)
            .map(|k| format!("case-{case}:{strategy}:{k}"))
            .collect(),
        conns,
        model: Model::new(strategy),
        handed_out: BTreeMap::new(),
    };
    let outcome =
        support::steps_until_divergence(&mut run, &strategy.to_string(), ops, tally).await;
    for c in &mut run.conns {
        support::end_with_backend(checker, c.pid, c.tx.take(), c.waiting.take()).await;
    }
    outcome.map_err(|e| format!("{e}\nmodel: {:?}", run.model))
}

#[test]
fn sequences_follow_the_reference_model_step_by_step_under_every_strategy() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (db, checker) = rt.block_on(async {
        let (db, pool) = fresh_migrated_database(2, pgonce::migrate).await;
        sqlx::raw_sql(SCHEMA).execute(&pool).await.unwrap();
        (db, pool)
    });
    let tally = support::check_model(
        file!(),
        16,
        proptest::collection::vec(op(), 1..60),
        Tally::default(),
        |case, ops, tally| {
            rt.block_on(async {
                for strategy in Numbering::ALL {
                    run(&db, &checker, case, strategy, ops, tally).await?;
                }
                Ok(())
            })
        },
    );
    assert!(
        tally.waited > 0
            && tally.queued_behind_a_waiter > 0
            && tally.entry_waits > 0
            && tally.number_taken > 0
            && tally.reused > 0
            && tally.killed_in_tx > 0
            && tally.killed_waiting > 0,
        "the run reached waits (queued and on an entry), NumberTaken, reused numbers \
         and kills in a transaction and while waiting: {tally:?}"
    );
}
