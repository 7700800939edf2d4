//! pgmq 0.33 (its Rust client on sqlx 0.8, pgmq's SQL installed from the
//! crate's embedded copy, no extension): the queue most PostgreSQL users
//! pick for SQS-like semantics, doing the same work as pgonce's standard
//! queue. Producers call `pgmq.send` (batch 1) or `pgmq.send_batch`
//! (batch 10); consumers call `pgmq.read` with the same 30 s visibility
//! timeout as pgonce's default, then `pgmq.delete` for each message (one
//! call with every id at batch 10). The `pop` shape reads and deletes in
//! one call (at-most-once: a consumer crash loses the message, so it is
//! compared with the raw limit, not with pgonce).
//!
//! pgmq's `read` does not wait for messages; when a read comes back empty
//! the consumer sleeps 1 ms before the next, as the raw limit does. pgmq's
//! own `read_with_poll` would hold a connection in `pg_sleep` instead.

use std::sync::Arc;
use std::time::Duration;

use ::pgmq::PGMQueueExt;
use anyhow::Context;

use crate::bench::queue::{Flow, Meter, Shape, drive};
use crate::scratch::RunDatabase;

/// pgonce's default visibility timeout, in pgmq's unit (seconds).
const VISIBILITY_SECONDS: i32 = 30;

/// What a pgmq consumer does with what it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `read` then `delete`: at-least-once, as pgonce's receive + delete.
    ReadDelete,
    /// `pop`: read and delete in one statement, at-most-once.
    Pop,
}

/// pgmq's client on its own sqlx 0.8 pool, with pgmq's SQL installed, and
/// the run's pool, from which the bench reads the server's WAL.
pub(crate) struct Peer {
    queue: PGMQueueExt,
    server: sqlx::PgPool,
}

impl Peer {
    pub(crate) async fn open(db: &RunDatabase, max_connections: u32) -> anyhow::Result<Peer> {
        let pool = super::sqlx08_pool(db, max_connections, "pgmq").await?;
        let queue = PGMQueueExt::new_with_pool(pool).await;
        queue
            .install_sql_from_embedded()
            .await
            .context("installing pgmq's SQL")?;
        Ok(Peer {
            queue,
            server: db.pool().clone(),
        })
    }

    pub(crate) async fn run(&self, shape: Shape, batch: usize, mode: Mode) -> anyhow::Result<Flow> {
        let name = match mode {
            Mode::ReadDelete => format!("bench_b{batch}"),
            Mode::Pop => format!("bench_pop_b{batch}"),
        };
        self.queue.create(&name).await?;
        let name: Arc<str> = name.into();
        let produce = {
            let (queue, name) = (self.queue.clone(), name.clone());
            move |m: Arc<Meter>, _p: usize| {
                let (queue, name) = (queue.clone(), name.clone());
                async move {
                    while m.may_send(batch).await {
                        let sent = if batch == 1 {
                            queue.send(&name, &m.stamp()).await.map(|_| ())
                        } else {
                            let bodies: Vec<String> = (0..batch).map(|_| m.stamp()).collect();
                            queue.send_batch(&name, &bodies).await.map(|_| ())
                        };
                        if let Err(e) = sent {
                            m.error(e);
                        }
                    }
                }
            }
        };
        let consume = {
            let (queue, name) = (self.queue.clone(), name.clone());
            move |m: Arc<Meter>, _c: usize| {
                let (queue, name) = (queue.clone(), name.clone());
                async move {
                    while m.running() {
                        let taken = match mode {
                            Mode::Pop => queue.pop::<String>(&name).await.map(|got| {
                                got.into_iter().map(|g| (g.msg_id, g.message)).collect()
                            }),
                            Mode::ReadDelete => queue
                                .read_batch::<String>(&name, VISIBILITY_SECONDS, batch as i32)
                                .await
                                .map(|got| {
                                    got.into_iter().map(|g| (g.msg_id, g.message)).collect()
                                }),
                        };
                        let got: Vec<(i64, String)> = match taken {
                            Ok(got) => got,
                            Err(e) => {
                                m.error(e);
                                continue;
                            }
                        };
                        if got.is_empty() {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            continue;
                        }
                        if mode == Mode::ReadDelete {
                            let ids: Vec<i64> = got.iter().map(|g| g.0).collect();
                            let deleted = if ids.len() == 1 {
                                queue.delete(&name, ids[0]).await.map(usize::from)
                            } else {
                                queue.delete_batch(&name, &ids).await
                            };
                            match deleted {
                                Ok(n) if n == ids.len() => {}
                                Ok(n) => {
                                    m.error(format!("{n} of {} deleted", ids.len()));
                                    continue;
                                }
                                Err(e) => {
                                    m.error(e);
                                    continue;
                                }
                            }
                        }
                        got.iter().for_each(|g| m.consumed(&g.1));
                    }
                }
            }
        };
        let label = match mode {
            Mode::ReadDelete => format!("pgmq b{batch}"),
            Mode::Pop => format!("pgmq pop b{batch}"),
        };
        let flow = drive(&label, shape, &self.server, produce, consume).await;
        self.queue.drop_queue(&name).await.ok();
        Ok(flow)
    }
}
