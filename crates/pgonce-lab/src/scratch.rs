//! The database a `race`, `bench` or `demo` run works in: a scratch database
//! created for the run on the `--database-url` server, or on a throwaway
//! cluster when none is given; migrated, and dropped at the end.

use anyhow::Context;
use pgonce_testkit::{ScratchDatabase, Server};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use crate::report::Environment;

pub struct RunDatabase {
    server: Server,
    database: ScratchDatabase,
    pool: PgPool,
}

impl RunDatabase {
    /// Opens the server, creates a scratch database named after `purpose`,
    /// and applies pgonce's migrations to it. `max_connections` sizes the
    /// pool the run uses.
    pub async fn open(
        database_url: Option<&str>,
        purpose: &str,
        max_connections: u32,
    ) -> anyhow::Result<RunDatabase> {
        let server = Server::open(database_url).await?;
        if server.is_throwaway() {
            tracing::info!("no DATABASE_URL given: running on a throwaway PostgreSQL cluster");
        }
        let database = server
            .create_database(&format!("pgonce_{purpose}"))
            .await
            .with_context(|| format!("on {}", server.address()))?;
        let pool = database.pool(max_connections).await?;
        pgonce::migrate(&pool)
            .await
            .context("applying migrations")?;
        Ok(RunDatabase {
            server,
            database,
            pool,
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Options for the scratch database, for sessions of its own.
    pub fn options(&self) -> PgConnectOptions {
        self.database.options()
    }

    pub async fn environment(&self) -> anyhow::Result<Environment> {
        Environment::read(&self.pool, self.server.is_throwaway()).await
    }

    /// Drops the scratch database and stops a throwaway cluster.
    pub async fn close(mut self) -> anyhow::Result<()> {
        self.pool.close().await;
        if !self.server.is_throwaway() {
            self.database.clone().drop_database().await?;
        }
        self.server.shutdown();
        Ok(())
    }
}
