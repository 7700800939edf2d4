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
use pgonce_testkit::fresh_database;
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
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..2, 0u8..2).prop_map(|(key, request)| Op::Acquire { key, request }),
        3 => (0usize..4).prop_map(Op::Finish),
        1 => (0usize..4).prop_map(Op::Release),
        2 => (0u8..2).prop_map(Op::Expire),
        1 => (0u8..2).prop_map(Op::Age),
        1 => Just(Op::Collect),
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
}

fn fingerprint(request: u8) -> Vec<u8> {
    dedupe::fingerprint(&json!({ "request": request })).unwrap()
}

fn key_name(key: u8) -> String {
    format!("key-{key}")
}

async fn run(pool: &PgPool, case: u64, ops: &[Op], tally: &mut Tally) -> Result<(), String> {
    // A scope per case: cases share the database and never see each other.
    let scope = format!("case-{case}");
    let mut keys: BTreeMap<u8, Key> = BTreeMap::new();
    let mut holds: Vec<KeyHold> = Vec::new();
    let collector = Collector::new(pool.clone(), CollectorConfig::default()).unwrap();
    for (step, op) in ops.iter().enumerate() {
        let at = format!("step {step} {op:?}");
        match *op {
            Op::Acquire { key, request } => {
                let out =
                    dedupe::acquire(pool, &scope, &key_name(key), &fingerprint(request), HOLD)
                        .await;
                let model = keys.get(&key).cloned();
                match (model, out) {
                    (None, Ok(Acquired::Process(hold))) if hold.first_use => {
                        keys.insert(
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
                        holds.push(hold);
                    }
                    (Some(k), Err(Error::IdempotencyMismatch { .. })) if k.request != request => {}
                    (
                        Some(Key {
                            state: KeyState::Held { expired: false, .. },
                            ..
                        }),
                        Err(Error::IdempotencyInProgress { .. }),
                    ) => {}
                    (
                        Some(
                            k @ Key {
                                state: KeyState::Held { expired: true, .. },
                                ..
                            },
                        ),
                        Ok(Acquired::Process(hold)),
                    ) if !hold.first_use => {
                        tally.recovered += 1;
                        keys.insert(
                            key,
                            Key {
                                state: KeyState::Held {
                                    token: hold.token,
                                    expired: false,
                                },
                                ..k
                            },
                        );
                        holds.push(hold);
                    }
                    (
                        Some(Key {
                            state: KeyState::Done(stored),
                            ..
                        }),
                        Ok(Acquired::Replay(response)),
                    ) if stored == response => tally.replayed += 1,
                    (model, out) => {
                        return Err(format!("{at}: model {model:?}, database {out:?}"));
                    }
                }
            }
            Op::Finish(n) | Op::Release(n) => {
                let Some(hold) = holds.iter().rev().nth(n).cloned() else {
                    continue;
                };
                let key: u8 = hold.key["key-".len()..].parse().unwrap();
                let current = matches!(
                    keys.get(&key),
                    Some(Key { state: KeyState::Held { token, .. }, .. }) if *token == hold.token
                );
                let response = json!({ "by": hold.token });
                let out = if matches!(op, Op::Finish(_)) {
                    dedupe::finish(pool, &hold, &response).await
                } else {
                    dedupe::release(pool, &hold).await
                };
                match out {
                    Ok(()) if current => {
                        if matches!(op, Op::Finish(_)) {
                            keys.get_mut(&key).unwrap().state = KeyState::Done(response);
                        } else {
                            keys.remove(&key);
                        }
                    }
                    Err(Error::LeaseLost { .. }) if !current => tally.lost += 1,
                    out => {
                        return Err(format!("{at}: current {current}, database {out:?}"));
                    }
                }
            }
            Op::Expire(key) => {
                sqlx::query(
                    "UPDATE pgonce.idempotency_keys SET held_until = now() - interval '1 s' \
                     WHERE scope = $1 AND key = $2 AND status = 'in_progress'",
                )
                .bind(&scope)
                .bind(key_name(key))
                .execute(pool)
                .await
                .map_err(|e| format!("{at}: {e}"))?;
                if let Some(Key {
                    state: KeyState::Held { expired, .. },
                    ..
                }) = keys.get_mut(&key)
                {
                    *expired = true;
                }
            }
            Op::Age(key) => {
                sqlx::query(
                    "UPDATE pgonce.idempotency_keys SET created_at = now() - interval '30 days' \
                     WHERE scope = $1 AND key = $2",
                )
                .bind(&scope)
                .bind(key_name(key))
                .execute(pool)
                .await
                .map_err(|e| format!("{at}: {e}"))?;
                if let Some(k) = keys.get_mut(&key) {
                    k.aged = true;
                }
            }
            Op::Collect => {
                collector
                    .run_once()
                    .await
                    .map_err(|e| format!("{at}: {e}"))?;
                let before = keys.len();
                keys.retain(|_, k| {
                    !(k.aged
                        && matches!(
                            k.state,
                            KeyState::Done(_) | KeyState::Held { expired: true, .. }
                        ))
                });
                tally.collected += (before - keys.len()) as u64;
            }
        }
        check_rows(pool, &scope, &keys)
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
        |case, ops, tally| rt.block_on(run(&pool, case, ops, tally)),
    );
    assert!(
        tally.recovered > 0 && tally.replayed > 0 && tally.lost > 0 && tally.collected > 0,
        "the run reached recoveries, replays, lost holds and collection: {tally:?}"
    );
}
