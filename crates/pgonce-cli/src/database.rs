//! How the product's commands (`migrate`, `serve`, `worker`, `rollout`)
//! reach the database a user names. Unlike the lab, they never start a
//! cluster or create a database: a deployment's database exists already.

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

/// How long the first connection may take at least before the command
/// gives up with an error naming the address: a wrong host or a closed
/// port is a configuration error, and an operator should hear of it at
/// once. Longer when `database.acquire_timeout` is: see [`Database::open`].
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The database `url` names, checked reachable.
#[derive(Debug, Clone)]
pub struct Database {
    options: PgConnectOptions,
}

impl Database {
    /// Parses `url` and opens (and closes) one connection within
    /// [`CONNECT_TIMEOUT`] or `acquire_timeout` (the pool's bound on
    /// opening one), whichever is longer, so that a bad URL or an
    /// unreachable server fails with one line that names the address. Not
    /// within less than the pool's bound: a server that takes longer than
    /// 5 s to let a session in (a distant one, TLS, a slow login), for
    /// which the operator gave the pool longer, gave up at every start,
    /// and a command restarted by a service manager never got a connection.
    pub async fn open(url: &str, acquire_timeout: Duration) -> anyhow::Result<Database> {
        let options = PgConnectOptions::from_str(url)
            .context("the database URL is not a valid PostgreSQL URL")?;
        let database = Database { options };
        let address = database.address();
        let within = CONNECT_TIMEOUT.max(acquire_timeout);
        let connection = tokio::time::timeout(within, database.options.connect())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "cannot connect to PostgreSQL at {address}: no answer within {within:?}"
                )
            })?
            .map_err(|e| {
                // A pooler set up wrongly is named with its fix.
                let e = match pgonce::Error::from(e) {
                    pgonce::Error::Database(e) => pgonce::error::describe(&e),
                    other => other.to_string(),
                };
                anyhow::anyhow!("cannot connect to PostgreSQL at {address}: {e}")
            })?;
        let _ = connection.close().await;
        Ok(database)
    }

    /// Where the database is, for messages: `host:port/database`.
    pub fn address(&self) -> String {
        format!(
            "{}:{}/{}",
            self.options.get_host(),
            self.options.get_port(),
            self.options.get_database().unwrap_or("")
        )
    }

    /// A pool of at most `max_connections` on this database, whose callers
    /// wait at most `acquire_timeout` for a connection (including opening
    /// one): past it, they fail instead of waiting on a database that does
    /// not answer.
    pub async fn pool(
        &self,
        max_connections: u32,
        acquire_timeout: Duration,
    ) -> anyhow::Result<PgPool> {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(acquire_timeout)
            .connect_with(self.options.clone())
            .await
            .map_err(pgonce::Error::from)
            .with_context(|| format!("connecting to {}", self.address()))
    }
}
