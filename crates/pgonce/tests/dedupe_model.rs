//! A reference model of idempotency keys, checked step by step against
//! PostgreSQL.
//!
//! Random sequences of acquires (two keys, two requests each), finishes
//! and releases under any hold issued so far (stale ones included), hold
//! expiry, ageing past the retention, and collection run against an
//! in-memory model of the contract and the database. After every step the
//! outcome (`Process` and whether it is a first use, `Replay` and its
//! response, `IdempotencyInProgress`, `IdempotencyMismatch`, `LeaseLost`)
//! and every key's row must be what the model says.
//!
//! Races, step by step: a finish or release is left uncommitted in a
//! transaction of its own while a contender (an acquire of its key by
//! either request, a finish or release under any hold, a collection) runs;
//! then that transaction commits, rolls back, or dies with its backend
//! (`pg_terminate_backend`). The model says whether the contender waits:
//! only on the row the open transaction wrote, which an acquire of that
//! key always meets, a finish or release only under the hold the row
//! still carries, and a collection never (it skips locked rows). A waiting
//! contender must be seen blocked on that transaction (pg_locks,
//! `pg_blocking_pids`) before it ends, and then finish as the model says
//! once the end is applied; one that does not wait must finish at once,
//! not seeing the uncommitted write.
//!
//! Time is moved, never waited for: a hold runs out, or a key ages past its
//! retention, by an `UPDATE` that sets the row's timestamp into the past.
//!
//! `MODEL_TEST_CASES` sets the number of cases (default 16); see
//! docs/testing.md.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use pgonce::Error;
use pgonce::dedupe::{self, Acquired, Collector, CollectorConfig, KeyHold};
use pgonce_testkit::{Interleaving, ScratchDatabase, Session, fresh_database};
use proptest::prelude::*;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

/// Holds long enough that only the model's `Expire` ends one.
const HOLD: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone)]
enum Op {
    /// Request `request` (0 or 1: its fingerprint) under key `key` (0 or 1).
    Acquire {
        key: u8,
        request: u8,
    },
    /// Holds are counted from the newest issued, stale ones included.
    Finish(usize),
    Release(usize),
    /// The key's hold runs out, if it has one.
    Expire(u8),
    /// The key was first used 30 days ago (the retention is 24 h).
    Age(u8),
    Collect,
    /// Under hold `hold`, a finish (or a release) in a transaction left
    /// open; `contender` runs meanwhile; the transaction then ends as
    /// `end` says.
    Race {
        hold: usize,
        finish: bool,
        contender: Contender,
        end: End,
    },
}

/// What runs while a finish or release is uncommitted.
#[derive(Debug, Clone, Copy)]
enum Contender {
    /// Request `request` under the open transaction's key.
    Acquire {
        request: u8,
    },
    Finish(usize),
    Release(usize),
    Collect,
}

/// How the open transaction ends.
#[derive(Debug, Clone, Copy)]
enum End {
    Commit,
    Rollback,
    /// Its backend terminated.
    Kill,
}

fn op() -> impl Strategy<Value = Op> {
    let contender = prop_oneof![
        (0u8..2).prop_map(|request| Contender::Acquire { request }),
        (0usize..4).prop_map(Contender::Finish),
        (0usize..4).prop_map(Contender::Release),
        Just(Contender::Collect),
    ];
    let end = prop_oneof![Just(End::Commit), Just(End::Rollback), Just(End::Kill)];
    prop_oneof![
        4 => (0u8..2, 0u8..2).prop_map(|(key, request)| Op::Acquire { key, request }),
        3 => (0usize..4).prop_map(Op::Finish),
        1 => (0usize..4).prop_map(Op::Release),
        2 => (0u8..2).prop_map(Op::Expire),
        1 => (0u8..2).prop_map(Op::Age),
        1 => Just(Op::Collect),
        3 => (0usize..2, any::<bool>(), contender, end).prop_map(|(hold, finish, contender, end)| {
            Op::Race { hold, finish, contender, end }
        }),
    ]
}

/// A key as the contract says it stands.
#[derive(Debug, Clone, PartialEq)]
enum KeyState {
    Held { token: Uuid, expired: bool },
    Done(Value),
}

#[derive(Debug, Clone)]
struct Key {
    request: u8,
    state: KeyState,
    aged: bool,
}

/// A key's row, as stored.
#[derive(Debug, sqlx::FromRow)]
struct Row {
    key: String,
    fingerprint: Vec<u8>,
    status: String,
    hold_token: Option<Uuid>,
    response: Option<Value>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    recovered: u64,
    replayed: u64,
    lost: u64,
    collected: u64,
    /// Contenders seen waiting for an open finish or release.
    waited: u64,
    /// Open transactions that ended with their backend.
    killed: u64,
}

fn fingerprint(request: u8) -> Vec<u8> {
    dedupe::fingerprint(&json!({ "request": request })).unwrap()
}

fn key_name(key: u8) -> String {
    format!("key-{key}")
}

fn key_of(hold: &KeyHold) -> u8 {
    hold.key["key-".len()..].parse().unwrap()
}

/// What a finish under `hold` stores: awkward on purpose (a float past
/// 1e16, keys out of order), as a replay must give it back as given.
fn response(hold: &KeyHold) -> Value {
    json!({ "by": hold.token, "amount": 1e16, "order": { "z": 1, "a": 2 } })
}

/// `value` serialised, as a service would send it.
fn text(value: &Value) -> String {
    serde_json::to_string(value).unwrap()
}

/// The contract's state: every key, and every hold issued (stale ones
/// included).
#[derive(Debug, Default)]
struct Model {
    keys: BTreeMap<u8, Key>,
    holds: Vec<KeyHold>,
}

impl Model {
    /// The `n`-th newest hold issued, if there are that many.
    fn hold(&self, n: usize) -> Option<KeyHold> {
        self.holds.iter().rev().nth(n).cloned()
    }

    /// Whether `hold` is the one its key carries.
    fn current(&self, hold: &KeyHold) -> bool {
        matches!(
            self.keys.get(&key_of(hold)),
            Some(Key { state: KeyState::Held { token, .. }, .. }) if *token == hold.token
        )
    }

    /// An acquire's outcome against the model, which it then follows.
    fn acquired(
        &mut self,
        key: u8,
        request: u8,
        out: pgonce::Result<Acquired>,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let model = self.keys.get(&key).cloned();
        match (model, out) {
            (None, Ok(Acquired::Process(hold))) if hold.first_use => {
                self.keys.insert(
                    key,
                    Key {
                        request,
                        state: KeyState::Held {
                            token: hold.token,
                            expired: false,
                        },
                        aged: false,
                    },
                );
                self.holds.push(hold);
            }
            (Some(k), Err(Error::IdempotencyMismatch { .. })) if k.request != request => {}
            (
                Some(Key {
                    state: KeyState::Held { expired: false, .. },
                    request: held_for,
                    ..
                }),
                Err(Error::IdempotencyInProgress { .. }),
            ) if held_for == request => {}
            (
                Some(
                    k @ Key {
                        state: KeyState::Held { expired: true, .. },
                        ..
                    },
                ),
                Ok(Acquired::Process(hold)),
            ) if !hold.first_use && k.request == request => {
                tally.recovered += 1;
                self.keys.insert(
                    key,
                    Key {
                        state: KeyState::Held {
                            token: hold.token,
                            expired: false,
                        },
                        ..k
                    },
                );
                self.holds.push(hold);
            }
            (
                Some(Key {
                    state: KeyState::Done(stored),
                    request: done_for,
                    ..
                }),
                Ok(Acquired::Replay(replayed)),
            ) if done_for == request && replayed == stored && text(&replayed) == text(&stored) => {
                tally.replayed += 1
            }
            (model, out) => return Err(format!("model {model:?}, database {out:?}")),
        }
        Ok(())
    }

    /// A finish's or release's outcome under `hold`: `Ok` while the hold
    /// is current, `LeaseLost` otherwise. Applied to the model when
    /// `commits` (an open transaction's write is applied once it commits).
    fn ended(
        &mut self,
        hold: &KeyHold,
        finish: bool,
        out: pgonce::Result<()>,
        commits: bool,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let current = self.current(hold);
        match out {
            Ok(()) if current => {
                if commits {
                    self.apply(hold, finish);
                }
                Ok(())
            }
            Err(Error::LeaseLost { .. }) if !current => {
                tally.lost += 1;
                Ok(())
            }
            out => Err(format!("current {current}, database {out:?}")),
        }
    }

    /// A current hold's finish or release, committed.
    fn apply(&mut self, hold: &KeyHold, finish: bool) {
        let key = key_of(hold);
        if finish {
            self.keys.get_mut(&key).unwrap().state = KeyState::Done(response(hold));
        } else {
            self.keys.remove(&key);
        }
    }

    /// A collection: every aged key that is done or whose hold ran out,
    /// but `spared` (its row locked by an open transaction).
    fn collected(&mut self, spared: Option<u8>, tally: &mut Tally) {
        let before = self.keys.len();
        self.keys.retain(|key, k| {
            Some(*key) == spared
                || !(k.aged
                    && matches!(
                        k.state,
                        KeyState::Done(_) | KeyState::Held { expired: true, .. }
                    ))
        });
        tally.collected += (before - self.keys.len()) as u64;
    }
}

/// What a contender returned.
#[derive(Debug)]
enum Contended {
    Acquired(pgonce::Result<Acquired>),
    Ended(pgonce::Result<()>),
    Collected(pgonce::Result<()>),
}

/// One case: its scope, the model, and the sessions of its races.
struct Run<'a> {
    pool: &'a PgPool,
    scope: String,
    model: Model,
    collector: Collector,
    race: Interleaving,
    /// Where a finish or release is left open.
    open: Session,
    /// Where the contender runs.
    contender: Session,
}

impl Run<'_> {
    async fn step(&mut self, op: &Op, tally: &mut Tally) -> Result<(), String> {
        match *op {
            Op::Acquire { key, request } => {
                let out = dedupe::acquire(
                    self.pool,
                    &self.scope,
                    &key_name(key),
                    &fingerprint(request),
                    HOLD,
                )
                .await;
                self.model.acquired(key, request, out, tally)?;
            }
            Op::Finish(n) | Op::Release(n) => {
                let Some(hold) = self.model.hold(n) else {
                    return Ok(());
                };
                let finish = matches!(op, Op::Finish(_));
                let out = if finish {
                    dedupe::finish(self.pool, &hold, &response(&hold)).await
                } else {
                    dedupe::release(self.pool, &hold).await
                };
                self.model.ended(&hold, finish, out, true, tally)?;
            }
            Op::Expire(key) => {
                sqlx::query(
                    "UPDATE pgonce.idempotency_keys SET held_until = now() - interval '1 s' \
                     WHERE scope = $1 AND key = $2 AND status = 'in_progress'",
                )
                .bind(&self.scope)
                .bind(key_name(key))
                .execute(self.pool)
                .await
                .map_err(|e| e.to_string())?;
                if let Some(Key {
                    state: KeyState::Held { expired, .. },
                    ..
                }) = self.model.keys.get_mut(&key)
                {
                    *expired = true;
                }
            }
            Op::Age(key) => {
                sqlx::query(
                    "UPDATE pgonce.idempotency_keys SET created_at = now() - interval '30 days' \
                     WHERE scope = $1 AND key = $2",
                )
                .bind(&self.scope)
                .bind(key_name(key))
                .execute(self.pool)
                .await
                .map_err(|e| e.to_string())?;
                if let Some(k) = self.model.keys.get_mut(&key) {
                    k.aged = true;
                }
            }
            Op::Collect => {
                self.collector.run_once().await.map_err(|e| e.to_string())?;
                self.model.collected(None, tally);
            }
            Op::Race {
                hold,
                finish,
                contender,
                end,
            } => {
                let Some(hold) = self.model.hold(hold) else {
                    return Ok(());
                };
                self.race(hold, finish, contender, end, tally).await?;
            }
        }
        Ok(())
    }

    /// Op::Race under `hold`, step by step.
    async fn race(
        &mut self,
        hold: KeyHold,
        finish: bool,
        contender: Contender,
        end: End,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let key = key_of(&hold);
        let (mut tx, pid) = support::begin_noting_pid(&self.race, &self.open).await?;
        let what = if finish { "finish" } else { "release" };
        let written = self
            .race
            .step(&self.open, what, async {
                if finish {
                    dedupe::finish(&mut *tx, &hold, &response(&hold)).await
                } else {
                    dedupe::release(&mut *tx, &hold).await
                }
            })
            .await
            .map_err(|e| e.to_string())?;
        // Its row is locked until the end only if the write matched it.
        let locked = self.model.current(&hold);
        self.model
            .ended(&hold, finish, written, false, tally)
            .map_err(|e| format!("open {what}: {e}"))?;
        let waits = locked
            && match contender {
                Contender::Acquire { .. } => true,
                Contender::Finish(n) | Contender::Release(n) => self
                    .model
                    .hold(n)
                    .is_some_and(|h| key_of(&h) == key && self.model.current(&h)),
                Contender::Collect => false,
            };
        let (what, task) = self.contender_task(key, contender);
        let contended = if waits {
            let waiting = self
                .race
                .step_blocks(&self.contender, &what, task)
                .await
                .map_err(|e| e.to_string())?;
            if waiting.blocked_by() != ["O"] {
                return Err(format!("{what} waits for {:?}", waiting.blocked_by()));
            }
            tally.waited += 1;
            let commits = self.end(tx, pid, end, tally).await?;
            if commits && locked {
                self.model.apply(&hold, finish);
            }
            waiting.resume().await.map_err(|e| e.to_string())?
        } else {
            let out = self
                .race
                .step(&self.contender, &what, task)
                .await
                .map_err(|e| e.to_string())?;
            self.check_contended(key, contender, out, locked, tally)
                .map_err(|e| format!("{what}, not waiting: {e}"))?;
            let commits = self.end(tx, pid, end, tally).await?;
            if commits && locked {
                self.model.apply(&hold, finish);
            }
            return Ok(());
        };
        self.check_contended(key, contender, contended, false, tally)
            .map_err(|e| format!("{what}, after the wait: {e}"))
    }

    /// The contender as a task of its own, and its description.
    fn contender_task(
        &self,
        key: u8,
        contender: Contender,
    ) -> (
        String,
        impl std::future::Future<Output = Contended> + Send + 'static,
    ) {
        let pool = self.contender.pool().clone();
        let scope = self.scope.clone();
        let hold = match contender {
            Contender::Finish(n) | Contender::Release(n) => self.model.hold(n),
            Contender::Acquire { .. } | Contender::Collect => None,
        };
        let what = format!("{contender:?}");
        let task = async move {
            match (contender, hold) {
                (Contender::Acquire { request }, _) => Contended::Acquired(
                    dedupe::acquire(&pool, &scope, &key_name(key), &fingerprint(request), HOLD)
                        .await,
                ),
                (Contender::Finish(_), Some(hold)) => {
                    Contended::Ended(dedupe::finish(&pool, &hold, &response(&hold)).await)
                }
                (Contender::Release(_), Some(hold)) => {
                    Contended::Ended(dedupe::release(&pool, &hold).await)
                }
                (Contender::Finish(_) | Contender::Release(_), None) => Contended::Ended(Ok(())),
                (Contender::Collect, _) => {
                    let collector = Collector::new(pool, CollectorConfig::default()).unwrap();
                    Contended::Collected(collector.run_once().await.map(drop))
                }
            }
        };
        (what, task)
    }

    /// A contender's outcome against the model; `spared` when the open
    /// transaction still holds `key`'s row (a collection skips it).
    fn check_contended(
        &mut self,
        key: u8,
        contender: Contender,
        out: Contended,
        spared: bool,
        tally: &mut Tally,
    ) -> Result<(), String> {
        match (contender, out) {
            (Contender::Acquire { request }, Contended::Acquired(out)) => {
                self.model.acquired(key, request, out, tally)
            }
            (Contender::Finish(n) | Contender::Release(n), Contended::Ended(out)) => {
                let Some(hold) = self.model.hold(n) else {
                    return out.map_err(|e| e.to_string());
                };
                let finish = matches!(contender, Contender::Finish(_));
                self.model.ended(&hold, finish, out, true, tally)
            }
            (Contender::Collect, Contended::Collected(out)) => {
                out.map_err(|e| e.to_string())?;
                self.model.collected(spared.then_some(key), tally);
                Ok(())
            }
            (contender, out) => Err(format!("{contender:?} returned {out:?}")),
        }
    }

    /// Ends the open transaction as `end` says; whether it committed.
    async fn end(
        &self,
        tx: sqlx::Transaction<'static, sqlx::Postgres>,
        pid: i32,
        end: End,
        tally: &mut Tally,
    ) -> Result<bool, String> {
        match end {
            End::Commit => {
                self.race
                    .try_step(&self.open, "COMMIT", tx.commit())
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(true)
            }
            End::Rollback => {
                self.race
                    .try_step(&self.open, "ROLLBACK", tx.rollback())
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(false)
            }
            End::Kill => {
                // Returns once the backend has exited, its locks released.
                let gone: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
                    .bind(pid)
                    .fetch_one(self.pool)
                    .await
                    .map_err(|e| e.to_string())?;
                if !gone {
                    return Err(format!("backend {pid} did not exit"));
                }
                self.race.note(&self.open, "killed");
                drop(tx);
                tally.killed += 1;
                Ok(false)
            }
        }
    }
}

/// Case `case`'s operations, on sessions of their own.
async fn run(
    db: &ScratchDatabase,
    pool: &PgPool,
    case: u64,
    ops: &[Op],
    tally: &mut Tally,
) -> Result<(), String> {
    let race = Interleaving::new(db.options())
        .await
        .map_err(|e| e.to_string())?;
    let open = race.session("O").await.map_err(|e| e.to_string())?;
    let contender = race.session("C").await.map_err(|e| e.to_string())?;
    let mut run = Run {
        pool,
        // A scope per case: cases share the database and never see each other.
        scope: format!("case-{case}"),
        model: Model::default(),
        collector: Collector::new(pool.clone(), CollectorConfig::default()).unwrap(),
        race,
        open,
        contender,
    };
    for (step, op) in ops.iter().enumerate() {
        let at = format!("step {step} {op:?}");
        run.step(op, tally)
            .await
            .map_err(|e| format!("{at}: {e}"))?;
        check_rows(pool, &run.scope, &run.model.keys)
            .await
            .map_err(|e| format!("{at}: {e}"))?;
    }
    Ok(())
}

/// Every key's row is what the model says, and no other row exists.
async fn check_rows(pool: &PgPool, scope: &str, keys: &BTreeMap<u8, Key>) -> Result<(), String> {
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT key, fingerprint, status, hold_token, response \
         FROM pgonce.idempotency_keys WHERE scope = $1 ORDER BY key",
    )
    .bind(scope)
    .fetch_all(pool)
    .await
    .map_err(|e| e.to_string())?;
    let names: Vec<String> = keys.keys().map(|k| key_name(*k)).collect();
    let stored: Vec<String> = rows.iter().map(|r| r.key.clone()).collect();
    if stored != names {
        return Err(format!("keys: model {names:?}, database {stored:?}"));
    }
    for (row, (_, key)) in rows.iter().zip(keys) {
        let fine = row.fingerprint == fingerprint(key.request)
            && match &key.state {
                KeyState::Held { token, .. } => {
                    row.status == "in_progress" && row.hold_token == Some(*token)
                }
                KeyState::Done(response) => {
                    row.status == "done" && row.response.as_ref() == Some(response)
                }
            };
        if !fine {
            return Err(format!("row: model {key:?}, database {row:?}"));
        }
    }
    Ok(())
}

#[test]
fn idempotency_keys_follow_the_reference_model_step_by_step() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt.block_on(fresh_database());
    let pool = rt.block_on(async {
        let pool = db.pool(4).await.unwrap();
        pgonce::migrate(&pool).await.unwrap();
        pool
    });
    let tally = support::check_model(
        file!(),
        16,
        proptest::collection::vec(op(), 1..60),
        Tally::default(),
        |case, ops, tally| rt.block_on(run(&db, &pool, case, ops, tally)),
    );
    assert!(
        tally.recovered > 0
            && tally.replayed > 0
            && tally.lost > 0
            && tally.collected > 0
            && tally.waited > 0
            && tally.killed > 0,
        "the run reached recoveries, replays, lost holds, collection, contenders \
         waiting for an open finish or release, and open transactions killed: {tally:?}"
    );
}
