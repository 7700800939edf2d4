//! A run's scratch database reached through PgBouncer in transaction mode,
//! the way most hosted PostgreSQL runs: `pgonce demo --pooler` starts the
//! pooler in front of the run's server, hands the run a pool through it,
//! and stops it at the end. LISTEN cannot go through it (a notification
//! would reach whichever client holds the server connection next), so the
//! run listens as [`ListenMode`] says: over a direct connection by default.

use anyhow::Context;
use pgonce::Listen;
use pgonce_testkit::Pooler;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::scratch::RunDatabase;

/// Where a run LISTENs for queue notifications (`--listen`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ListenMode {
    /// On a connection like the pool's: wrong behind a transaction-mode
    /// pooler (kept to show what that does).
    Pool,
    /// Over a direct connection to the server, around the pooler.
    Direct,
    /// Not at all: receivers poll on their timer only.
    Off,
}

impl ListenMode {
    /// The library's setting for a run on `db`.
    pub(crate) fn listen(self, db: &RunDatabase) -> Listen {
        match self {
            ListenMode::Pool => Listen::Pool,
            ListenMode::Direct => Listen::Direct(Box::new(db.options())),
            ListenMode::Off => Listen::Off,
        }
    }
}

/// PgBouncer in front of a run's database, and a pool through it.
/// Dropping it stops the pooler.
pub(crate) struct BehindPooler {
    pool: PgPool,
    pooler: Pooler,
}

impl BehindPooler {
    /// Starts PgBouncer (transaction mode, `max_prepared_statements` set:
    /// the supported set-up) in front of `db`'s server, and opens a pool of
    /// `max_connections` to `db` through it.
    pub(crate) async fn start(
        db: &RunDatabase,
        max_connections: u32,
    ) -> anyhow::Result<BehindPooler> {
        let upstream = db.options();
        // Starting waits (blocking) until PgBouncer accepts connections.
        let pooler = tokio::task::spawn_blocking(move || Pooler::start(&upstream))
            .await
            .context("starting PgBouncer")??;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(pooler.options(db.name()))
            .await
            .map_err(pgonce::Error::from)
            .with_context(|| format!("connecting through PgBouncer on port {}", pooler.port()))?;
        Ok(BehindPooler { pool, pooler })
    }

    /// The pool through the pooler.
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Closes the pool and stops the pooler.
    pub(crate) async fn close(mut self) {
        self.pool.close().await;
        self.pooler.stop();
    }
}

/// How many other client connections [`sessions_survive`] opens, at most,
/// looking for one that runs on the server session it saw.
const PROBES: usize = 8;

/// Whether a client connection to where `pool` connects keeps one server
/// session from one transaction to the next: true directly and through a
/// session-mode pooler, false through a transaction-mode pooler, where a
/// session-level lock taken in one transaction may be held by a server
/// connection that then serves someone else (and never be released).
///
/// How: a client reads its server process id, then other clients open
/// transactions and read theirs, each holding its transaction (so each
/// pins a server connection), until one sees the first client's process
/// id: a transaction pooler handed that server session to another client.
/// A pooler that hands out its most recently used server connection first
/// (PgBouncer's default) does so at the first probe; one that goes round
/// robin within `PROBES` probes as long as its pool is no bigger. Directly, no
/// other client can ever see the first one's process id. All through the
/// simple query protocol, which any pooler carries.
pub(crate) async fn sessions_survive(pool: &PgPool) -> anyhow::Result<bool> {
    use sqlx::{Connection, PgConnection, Row};
    async fn pid(conn: &mut PgConnection) -> sqlx::Result<i32> {
        sqlx::raw_sql("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await?
            .try_get(0)
    }
    let options = pool.connect_options();
    let check = async {
        let mut own = PgConnection::connect_with(&options).await?;
        let seen = pid(&mut own).await?;
        let mut probes = Vec::new();
        let mut shared = false;
        for _ in 0..PROBES {
            let mut probe = PgConnection::connect_with(&options).await?;
            sqlx::raw_sql("BEGIN").execute(&mut probe).await?;
            shared = pid(&mut probe).await? == seen;
            probes.push(probe);
            if shared {
                break;
            }
        }
        // With every probe's server connection pinned, the first client
        // must be on its own session still.
        shared |= pid(&mut own).await? != seen;
        for mut probe in probes {
            sqlx::raw_sql("ROLLBACK").execute(&mut probe).await?;
            probe.close().await?;
        }
        own.close().await?;
        anyhow::Ok(!shared)
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), check)
        .await
        .context("telling whether sessions survive: no answer within 30 s")?
}

/// Where a bench's queues LISTEN on `pool`: on the pool's own connections
/// when sessions survive ([`sessions_survive`]); else not at all
/// ([`Listen::Off`], with the reason to report), since a bench is given one
/// URL and has no direct route around the pooler.
pub(crate) async fn bench_listen(pool: &PgPool) -> anyhow::Result<(Listen, Option<&'static str>)> {
    Ok(match sessions_survive(pool).await? {
        true => (Listen::Pool, None),
        false => (Listen::Off, Some(LISTEN_OFF)),
    })
}

/// Why a bench polls instead of listening behind a transaction pooler.
pub(crate) const LISTEN_OFF: &str = "sessions do not survive from one transaction to the next (a \
     transaction-mode pooler is in between): LISTEN would hand notifications to other clients, \
     so receivers poll (Listen::Off)";
