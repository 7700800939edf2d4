//! Mixed writers of the event store, driven step by step: the
//! transactions of a round (conditional appends on the query under test, on
//! other tags or on the round's type, by `begin_append` or by the one-call
//! `append`, unconditional appends, `append_in` in a caller's transaction,
//! rollbacks; each writer under the round's strategy or its own), an
//! interleaving of their steps that waits until
//! a step is seen blocked (pg_locks) before others go on, and the oracle
//! that judges a round. Used by the randomized rounds of tests/events.rs
//! and by the model of tests/events_model.rs.

use std::collections::BTreeSet;
use std::time::Duration;

use pgonce::events::{
    AppendCondition, AppendStrategy, Event, EventStore, EventStoreConfig, Query, StoredEvent,
};
use pgonce::{Error, IsolationLevel};
use pgonce_testkit::Interleaving;

/// A query for events carrying `tag`.
pub fn tag_query(tag: &str) -> Query {
    Query::item(Vec::<String>::new(), [tag]).unwrap()
}

/// An event carrying `tag`.
pub fn course(tag: &str) -> Event {
    Event::new("CourseDefined").tag(tag)
}

/// The type of the events a mixed round on tag `x` appends: its own, so
/// that a type-only condition matches the round's events and no other
/// round's.
pub fn round_type(x: &str) -> String {
    format!("{x}:type")
}

/// Why an append in a race did not commit, as a race table shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// `AppendConditionFailed`: a matching event after `after`.
    Condition,
    /// `SerializationFailure` (40001), at the check or at COMMIT.
    Serialization,
    /// `WrongIsolation`: the strategy refuses the caller's transaction.
    WrongIsolation,
    Other(String),
}

impl From<&Error> for Refused {
    fn from(e: &Error) -> Refused {
        match e {
            Error::AppendConditionFailed { .. } => Refused::Condition,
            Error::SerializationFailure { .. } => Refused::Serialization,
            Error::WrongIsolation { .. } => Refused::WrongIsolation,
            e => Refused::Other(e.to_string()),
        }
    }
}

/// The writers of a mixed round. Every event carries the round's tag `x`;
/// the conditions are on `x` (the query under test), on `y`, or on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MixedKind {
    /// Decides on `x`, appends an `x` event under "no `x` after".
    ConditionSame,
    /// Decides on `y`, appends an event tagged `x` and `y` under "no `y`
    /// after": a condition on other tags whose event matches `x`.
    ConditionOther,
    /// Decides on events carrying both `x` and `y`, appends one under "none
    /// after": a condition whose tags overlap both others'.
    ConditionBoth,
    /// Decides on the round's type (a type-only item), appends an `x`
    /// event under "none of that type after": every writer's event matches.
    ConditionType,
    /// `ConditionSame` through [`EventStore::append`]: the check, the
    /// insert and the commit in one call (one statement under the lock
    /// strategies), so its append step also ends it; never rolled back.
    ConditionSameAppend,
    /// `ConditionSameAppend` of two events in one call: under the lock
    /// strategies the tag-item statement that takes its events as one
    /// JSON array (migration 0170) rather than the one-event one (0180).
    ConditionSameBatchAppend,
    /// Decides on an item naming the round's type and `x`, appends an `x`
    /// event under "none after": an item with types, checked by the query
    /// built for its values (migration 0110's path, or the transaction
    /// path's filter), not the tag-item one.
    ConditionTyped,
    /// Decides on every event ([`Query::all`]), appends an `x` event
    /// under "none after" in one call: the match-all condition, which
    /// every other writer's event breaks.
    ConditionAllAppend,
    /// `begin_append` of an `x` event without a condition.
    Unconditional,
    /// `append_in` of an `x` event in the caller's transaction, begun at
    /// this isolation level.
    AppendIn(IsolationLevel),
}

impl MixedKind {
    /// Whether the writer appends through [`EventStore::append`], whose
    /// append step also commits.
    pub fn appends_in_one_call(self) -> bool {
        matches!(
            self,
            MixedKind::ConditionSameAppend
                | MixedKind::ConditionSameBatchAppend
                | MixedKind::ConditionAllAppend
        )
    }

    /// Whether the writer decides first and appends under a condition.
    pub fn is_conditional(self) -> bool {
        !matches!(self, MixedKind::Unconditional | MixedKind::AppendIn(_))
    }
}

/// One transaction of a mixed round and what became of it.
#[derive(Debug, Clone)]
pub struct MixedTx {
    pub kind: MixedKind,
    /// The strategy of this writer's store; `None`: the round's.
    pub strategy: Option<AppendStrategy>,
    /// Ends with ROLLBACK instead of COMMIT.
    pub rollback: bool,
    /// The condition's tag and `after`, for conditional kinds.
    pub condition: Option<(Query, Option<i64>)>,
    pub positions: Vec<i64>,
    pub committed: bool,
    pub refused: Option<Refused>,
    /// The positions a failed condition named (`AppendConditionFailed`).
    pub matching: Vec<i64>,
}

impl MixedTx {
    /// A transaction of `kind` not yet run (one appending in one call is
    /// never rolled back).
    pub fn new(kind: MixedKind, rollback: bool) -> MixedTx {
        MixedTx {
            kind,
            strategy: None,
            rollback: rollback && !kind.appends_in_one_call(),
            condition: None,
            positions: Vec::new(),
            committed: false,
            refused: None,
            matching: Vec::new(),
        }
    }

    /// Records why its append failed (and what a failed condition named).
    fn refuse(&mut self, e: &Error) {
        if let Error::AppendConditionFailed { matching, .. } = e {
            self.matching = matching.clone();
        }
        self.refused = Some(Refused::from(e));
    }
}

/// Runs `plan` one step per `go` (decide, append, end), reporting each step
/// on `done` with whether the transaction is over.
pub async fn mixed_tx(
    index: usize,
    store: EventStore,
    mut plan: MixedTx,
    [x, y]: [String; 2],
    mut go: tokio::sync::mpsc::UnboundedReceiver<()>,
    done: tokio::sync::mpsc::UnboundedSender<(usize, bool)>,
) -> MixedTx {
    enum Held {
        Pending(pgonce::events::PendingAppend),
        Caller(sqlx::Transaction<'static, sqlx::Postgres>),
    }
    let query = match plan.kind {
        MixedKind::ConditionSame
        | MixedKind::ConditionSameAppend
        | MixedKind::ConditionSameBatchAppend => Some(tag_query(&x)),
        MixedKind::ConditionTyped => Some(Query::item([round_type(&x)], [&x]).unwrap()),
        MixedKind::ConditionAllAppend => Some(Query::all()),
        MixedKind::ConditionOther => Some(tag_query(&y)),
        MixedKind::ConditionBoth => Some(Query::item(Vec::<String>::new(), [&x, &y]).unwrap()),
        MixedKind::ConditionType => {
            Some(Query::item([round_type(&x)], Vec::<String>::new()).unwrap())
        }
        _ => None,
    };
    let mut event = Event::new(round_type(&x)).tag(&x);
    if matches!(
        plan.kind,
        MixedKind::ConditionOther | MixedKind::ConditionBoth
    ) {
        event = event.tag(&y);
    }
    let mut condition = None;
    if let Some(query) = query {
        go.recv().await.unwrap();
        let decision = store.decide(&query).await.unwrap();
        plan.condition = Some((query.clone(), decision.after));
        condition = Some(AppendCondition::new(query, decision.after));
        done.send((index, false)).unwrap();
    }
    go.recv().await.unwrap();
    if plan.kind.appends_in_one_call() {
        let events = if plan.kind == MixedKind::ConditionSameBatchAppend {
            vec![event.clone(), event]
        } else {
            vec![event]
        };
        match store.append(&events, condition.as_ref()).await {
            Ok(appended) => {
                plan.positions = appended.positions;
                plan.committed = true;
            }
            Err(e) => plan.refuse(&e),
        }
        done.send((index, true)).unwrap();
        return plan;
    }
    let held = match plan.kind {
        MixedKind::AppendIn(level) => {
            let mut tx = pgonce::begin(store.pool(), level).await.unwrap();
            match store.append_in(&mut tx, &[event]).await {
                Ok(p) => {
                    plan.positions = p;
                    Ok(Held::Caller(tx))
                }
                Err(e) => Err(e),
            }
        }
        _ => store
            .begin_append(&[event], condition.as_ref())
            .await
            .map(|p| {
                plan.positions = p.positions().to_vec();
                Held::Pending(p)
            }),
    };
    let held = match held {
        Ok(h) => h,
        Err(e) => {
            plan.refuse(&e);
            done.send((index, true)).unwrap();
            return plan;
        }
    };
    done.send((index, false)).unwrap();
    go.recv().await.unwrap();
    let ended = match (held, plan.rollback) {
        (Held::Pending(p), true) => p.rollback().await,
        (Held::Pending(p), false) => p.commit().await.map(|_| ()),
        (Held::Caller(tx), true) => tx.rollback().await.map_err(Error::from),
        (Held::Caller(tx), false) => tx.commit().await.map_err(Error::from),
    };
    match ended {
        Ok(()) => plan.committed = !plan.rollback,
        Err(e) => plan.refused = Some(Refused::from(&e)),
    }
    done.send((index, true)).unwrap();
    plan
}

/// One interleaving of `plans` on `sessions` (one each): repeatedly the
/// transaction `choose(n)` picks among the `n` that are not running takes
/// its next step; the driver waits until that step reports or its backend
/// is seen waiting on a lock (then others go on, and it reports once
/// released).
pub async fn mixed_round(
    race: &Interleaving,
    sessions: &[pgonce_testkit::Session],
    strategy: AppendStrategy,
    round: usize,
    plans: Vec<MixedTx>,
    choose: &mut impl FnMut(usize) -> usize,
) -> Vec<MixedTx> {
    let tags = [format!("r{round}:x"), format!("r{round}:y")];
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
    let mut go = Vec::new();
    let mut tasks = Vec::new();
    // Steps left per transaction; its last one (COMMIT or ROLLBACK) waits on
    // no lock another transaction of the round holds, except one appending
    // in one call, whose append is its last step.
    let last_may_wait: Vec<bool> = plans.iter().map(|p| p.kind.appends_in_one_call()).collect();
    // Decide, append, end; one appending in one call ends with its append,
    // one without a condition has no decision.
    let mut left: Vec<usize> = plans
        .iter()
        .map(|p| {
            1 + usize::from(p.kind.is_conditional()) + usize::from(!p.kind.appends_in_one_call())
        })
        .collect();
    for (i, plan) in plans.into_iter().enumerate() {
        let (g, rx) = tokio::sync::mpsc::unbounded_channel();
        go.push(g);
        tasks.push(tokio::spawn(mixed_tx(
            i,
            EventStore::new(
                sessions[i].pool().clone(),
                EventStoreConfig {
                    strategy: plan.strategy.unwrap_or(strategy),
                    notify: false,
                    ..Default::default()
                },
            )
            .unwrap(),
            plan,
            tags.clone(),
            rx,
            done_tx.clone(),
        )));
    }
    // Per transaction: Some(true) running, Some(false) ready, None over.
    let mut running: Vec<Option<bool>> = vec![Some(false); tasks.len()];
    let record = |running: &mut Vec<Option<bool>>, (i, over): (usize, bool)| {
        running[i] = if over { None } else { Some(false) };
    };
    loop {
        let ready: Vec<usize> = (0..running.len())
            .filter(|&i| running[i] == Some(false))
            .collect();
        if ready.is_empty() {
            if running.iter().all(Option::is_none) {
                break;
            }
            let m = done.recv().await.unwrap();
            record(&mut running, m);
            continue;
        }
        let i = ready[choose(ready.len())];
        running[i] = Some(true);
        left[i] -= 1;
        go[i].send(()).unwrap();
        while running[i] == Some(true) {
            if left[i] == 0 && !last_may_wait[i] {
                let m = done.recv().await.unwrap();
                record(&mut running, m);
                continue;
            }
            tokio::select! {
                m = done.recv() => record(&mut running, m.unwrap()),
                _ = tokio::time::sleep(Duration::from_millis(2)) => {
                    if race.blockers_of(&sessions[i]).await.unwrap().is_some() {
                        break;
                    }
                }
            }
        }
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// The oracle: once every transaction ended, no committed conditional
/// append has a committed event matching its condition at a lower
/// position above its `after`. Also: exactly the committed appends are in
/// `log`. Returns the violations as (append's position, event's position).
pub fn mixed_violations(log: &[StoredEvent], txs: &[MixedTx]) -> Vec<(i64, i64)> {
    let committed: BTreeSet<i64> = txs
        .iter()
        .filter(|t| t.committed)
        .flat_map(|t| t.positions.iter().copied())
        .collect();
    let logged: BTreeSet<i64> = log.iter().map(|e| e.position).collect();
    assert_eq!(committed, logged, "exactly the committed appends: {txs:?}");
    let mut violations = Vec::new();
    for t in txs.iter().filter(|t| t.committed) {
        let Some((query, after)) = &t.condition else {
            continue;
        };
        let lowest = t.positions[0];
        for e in log {
            if e.position > after.unwrap_or(0) && e.position < lowest && query.matches(&e.event) {
                violations.push((lowest, e.position));
            }
        }
    }
    violations
}
