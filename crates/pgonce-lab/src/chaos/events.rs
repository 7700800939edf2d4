//! Scenario `events` (I5): one of the three append strategies, drawn per
//! round, under mixed writers, interleaved step by step by the driver in
//! `stepwise.rs`. Conditional writers decide on the round's claims, then
//! append a claim on the condition that none came since, then commit (or
//! roll back); between and inside their steps other writers append: claims
//! with no condition, events under another tag, and claims through
//! `append_in` in the caller's transaction at each isolation level the
//! strategy accepts. Every append stops before COMMIT
//! (`EventStore::begin_append`), so another writer's whole append can run
//! while one holds its locks, and a decision can wait on an append in
//! flight. No conditional append may commit above a claim its condition
//! forbids.

use rand::Rng;
use rand::rngs::StdRng;
use serde_json::{Value, json};

use sqlx::{Postgres, Transaction};

use pgonce::IsolationLevel;
use pgonce::events::{Decision, PendingAppend};
use pgonce::{AppendCondition, AppendStrategy, Event, EventStore, EventStoreConfig, Query};

use super::Mutant;
use super::faults::{self, FaultKind};
use super::history::Outcome;
use super::round::Round;
use super::schedule::{Action, Step, interleave, sprinkle_faults};
use super::stepwise::{self, OpenTransactions, Ran, Stepwise};

pub(crate) const TASKS: usize = 4;
/// The event type the conditions are about.
pub(crate) const CLAIM: &str = "ChaosClaimed";

pub(crate) fn plan(rng: &mut StdRng, faults: &[FaultKind]) -> Vec<Step> {
    let programs = (0..TASKS)
        .map(|task| {
            let mut program = Vec::new();
            for _ in 0..rng.random_range(1..=2) {
                match task {
                    // Conditional writers: decide, then append.
                    0 | 1 => program.extend([Action::Decide, Action::Append]),
                    // A writer with no condition, on the claims' tag or
                    // another.
                    2 => program.push(Action::AppendPlain {
                        other_tag: rng.random_bool(0.3),
                    }),
                    // A claim inside the caller's transaction.
                    _ => program.push(Action::AppendIn {
                        isolation: rng.random_range(0..3),
                    }),
                }
                program.push(if rng.random_bool(0.15) {
                    Action::Rollback
                } else {
                    Action::Commit
                });
            }
            program
        })
        .collect();
    let mut steps = interleave(rng, programs);
    sprinkle_faults(rng, &mut steps, faults, &[], TASKS, 1, 2);
    // The round's strategy, first, so a replay uses the same one.
    let strategy = rng.random_range(0..AppendStrategy::ALL.len() as u8);
    steps.insert(
        0,
        Step {
            task: 0,
            action: Action::UseStrategy { strategy },
        },
    );
    steps
}

/// The claims' tag of the round.
pub(crate) fn claim_tag(scope: &str) -> String {
    format!("claim:{scope}")
}

const ISOLATIONS: [IsolationLevel; 3] = IsolationLevel::ALL;

type Tx = Transaction<'static, Postgres>;

/// What a writer holds open between its append and its commit.
pub(crate) enum OpenAppend {
    /// `EventStore::begin_append`'s: inserted, condition checked.
    Pending(PendingAppend),
    /// The caller's transaction of an `append_in` (or the mutant's raw
    /// insert).
    Caller(Tx),
}

/// What a step that may wait on a lock hands back.
pub(crate) enum Finished {
    Decided(pgonce::Result<Decision>),
    Begun(pgonce::Result<PendingAppend>),
    AppendedIn(Tx, pgonce::Result<Vec<i64>>),
}

struct Writers {
    strategy: AppendStrategy,
    query: Query,
    tag: String,
    /// Per conditional writer: its decision's position, when the decision
    /// saw no claim (`Some(None)`: an empty log).
    decisions: Vec<Option<Option<i64>>>,
}

pub(crate) async fn run(round: &mut Round, steps: &[Step]) -> anyhow::Result<()> {
    // A schedule shrunk past its first step runs the default strategy.
    let strategy = steps
        .iter()
        .find_map(|s| match s.action {
            Action::UseStrategy { strategy } => AppendStrategy::ALL.get(strategy as usize).copied(),
            _ => None,
        })
        .unwrap_or(AppendStrategy::AdvisoryLocks);
    let tag = claim_tag(&round.scope);
    let mut writers = Writers {
        strategy,
        query: Query::item([CLAIM], [tag.as_str()])?,
        tag,
        decisions: vec![None; round.tasks()],
    };
    stepwise::run(&mut writers, round, steps).await
}

impl Writers {
    fn store(&self, round: &Round, task: usize) -> pgonce::Result<EventStore> {
        EventStore::new(
            round.session(task).clone(),
            EventStoreConfig {
                strategy: self.strategy,
                ..EventStoreConfig::default()
            },
        )
    }

    fn claim(&self, task: usize) -> Event {
        Event::new(CLAIM)
            .tag(self.tag.clone())
            .data(json!({ "task": task }))
    }
}

impl Stepwise for Writers {
    type Open = OpenAppend;
    type Done = Finished;
    const CLOSE: Action = Action::Rollback;

    async fn finished(
        &mut self,
        round: &mut Round,
        open: &mut OpenTransactions<OpenAppend>,
        task: usize,
        op: i64,
        done: Finished,
    ) {
        let succeeded = match done {
            Finished::Decided(decided) => {
                round.history.finish(
                    op,
                    &decided
                        .as_ref()
                        .map(|d| json!({ "after": d.after, "seen": d.events.len() })),
                );
                let ok = decided.is_ok();
                // The decision: claim only if nothing is claimed yet.
                self.decisions[task] = decided
                    .ok()
                    .filter(|d| d.events.is_empty())
                    .map(|d| d.after);
                ok
            }
            Finished::Begun(begun) => {
                round.history.finish(
                    op,
                    &begun
                        .as_ref()
                        .map(|p| json!({ "positions": p.positions() })),
                );
                let ok = begun.is_ok();
                if let Ok(pending) = begun {
                    open.put(task, OpenAppend::Pending(pending));
                }
                ok
            }
            Finished::AppendedIn(tx, appended) => {
                round
                    .history
                    .finish(op, &appended.as_ref().map(|p| json!({ "positions": p })));
                let ok = appended.is_ok();
                if ok {
                    open.put(task, OpenAppend::Caller(tx));
                } else {
                    // Aborted, or its connection gone: end it.
                    let _ = tx.rollback().await;
                }
                ok
            }
        };
        round.after_operation(task, succeeded);
    }

    async fn run_step(
        &mut self,
        round: &mut Round,
        open: &mut OpenTransactions<OpenAppend>,
        step: Step,
    ) -> anyhow::Result<Ran<Finished>> {
        let task = step.task;
        // A writer with an append open runs nothing but its end: its one
        // connection is taken.
        let needs_connection = !matches!(
            step.action,
            Action::Commit | Action::Rollback | Action::Fault { .. } | Action::UseStrategy { .. }
        );
        if needs_connection && open.is_open(task) {
            round.history.skip(task, step.action);
            return Ok(Ran::Finished);
        }
        let spawned = match step.action {
            Action::Fault { fault, target } => {
                faults::inject_generic(round, task, fault, target).await;
                return Ok(Ran::Finished);
            }
            Action::UseStrategy { .. } => {
                round.history.record(
                    task,
                    step.action,
                    json!({ "strategy": self.strategy.name() }),
                    Outcome::Skipped,
                );
                return Ok(Ran::Finished);
            }
            Action::Decide => {
                let store = self.store(round, task)?;
                let query = self.query.clone();
                let op = round.history.invoke(task, step.action, Value::Null);
                let step =
                    tokio::spawn(async move { Finished::Decided(store.decide(&query).await) });
                Ran::Spawned { op, step }
            }
            Action::Append => {
                let Some(after) = self.decisions[task].take() else {
                    round.history.skip(task, step.action);
                    return Ok(Ran::Finished);
                };
                let store = self.store(round, task)?;
                let op = round
                    .history
                    .invoke(task, step.action, json!({ "after": after }));
                let condition = AppendCondition::new(self.query.clone(), after);
                let claim = self.claim(task);
                let step = tokio::spawn(async move {
                    Finished::Begun(store.begin_append(&[claim], Some(&condition)).await)
                });
                Ran::Spawned { op, step }
            }
            Action::AppendPlain { other_tag } => {
                let event = if other_tag {
                    Event::new(CLAIM).tag(format!("other:{}", round.scope))
                } else {
                    self.claim(task)
                };
                let store = self.store(round, task)?;
                let op = round.history.invoke(task, step.action, Value::Null);
                let step = if round.mutant == Some(Mutant::EventsRawInsert) {
                    let session = round.session(task).clone();
                    tokio::spawn(async move {
                        match pgonce::begin(&session, IsolationLevel::ReadCommitted).await {
                            Ok(mut tx) => {
                                let inserted = raw_insert(&mut tx, &event).await;
                                Finished::AppendedIn(tx, inserted)
                            }
                            Err(e) => Finished::Begun(Err(e.into())),
                        }
                    })
                } else {
                    tokio::spawn(async move {
                        Finished::Begun(store.begin_append(&[event], None).await)
                    })
                };
                Ran::Spawned { op, step }
            }
            Action::AppendIn { isolation } => {
                // SERIALIZABLE only under the Serializable strategy, which
                // refuses anything else; any level under the others.
                let level = if self.strategy == AppendStrategy::Serializable {
                    IsolationLevel::Serializable
                } else {
                    ISOLATIONS[isolation as usize % ISOLATIONS.len()]
                };
                let store = self.store(round, task)?;
                let op = round.history.invoke(
                    task,
                    step.action,
                    json!({ "isolation": level.to_string() }),
                );
                let claim = self.claim(task);
                let session = round.session(task).clone();
                let step = tokio::spawn(async move {
                    match pgonce::begin(&session, level).await {
                        Ok(mut tx) => {
                            let appended = store.append_in(&mut tx, &[claim]).await;
                            Finished::AppendedIn(tx, appended)
                        }
                        Err(e) => Finished::Begun(Err(e.into())),
                    }
                });
                Ran::Spawned { op, step }
            }
            Action::Commit | Action::Rollback => {
                let Some(held) = open.take(task) else {
                    round.history.skip(task, step.action);
                    return Ok(Ran::Finished);
                };
                let op = round.history.invoke(task, step.action, Value::Null);
                let commit = step.action == Action::Commit;
                let ended: pgonce::Result<&str> = match held {
                    OpenAppend::Pending(pending) if commit => {
                        pending.commit().await.map(|_| "committed")
                    }
                    OpenAppend::Pending(pending) => {
                        pending.rollback().await.map(|()| "rolled back")
                    }
                    OpenAppend::Caller(tx) if commit => {
                        tx.commit().await.map(|()| "committed").map_err(Into::into)
                    }
                    OpenAppend::Caller(tx) => tx
                        .rollback()
                        .await
                        .map(|()| "rolled back")
                        .map_err(Into::into),
                };
                round.history.finish(op, &ended);
                round.after_operation(task, ended.is_ok());
                return Ok(Ran::Finished);
            }
            _ => {
                round.history.skip(task, step.action);
                return Ok(Ran::Finished);
            }
        };
        Ok(spawned)
    }
}

/// The mutant's writer: an insert that takes no publishing key.
async fn raw_insert(tx: &mut Tx, event: &Event) -> pgonce::Result<Vec<i64>> {
    let position: i64 = sqlx::query_scalar(include_str!("sql/mutant_events_insert.sql"))
        .bind(&event.event_type)
        .bind(&event.tags)
        .bind(&event.data)
        .fetch_one(&mut **tx)
        .await?;
    Ok(vec![position])
}
