//! The database a `race`, `bench` or `demo` run works in: a scratch database
//! created for the run on the `--database-url` server, or on a throwaway
//! cluster when none is given; migrated, and dropped at the end. Tests open
//! one on the test process's shared server ([`RunDatabase::for_tests`]).

use anyhow::Context;
use pgonce_testkit::{ScratchDatabase, Server, shared_for_tests};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use crate::report::Environment;

pub struct RunDatabase {
    /// The server opened for this run; `None` on the tests' shared server,
    /// which outlives the run.
    server: Option<Server>,
    throwaway: bool,
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
        let mut run = RunDatabase::create(&server, purpose, max_connections).await?;
        run.server = Some(server);
        Ok(run)
    }

    /// A scratch database on the server every test of the process shares
    /// (`DATABASE_URL`, or one throwaway cluster), migrated.
    pub async fn for_tests(purpose: &str) -> anyhow::Result<RunDatabase> {
        let server = shared_for_tests().map_err(anyhow::Error::msg)?;
        RunDatabase::create(server, purpose, 20).await
    }

    async fn create(
        server: &Server,
        purpose: &str,
        max_connections: u32,
    ) -> anyhow::Result<RunDatabase> {
        let database = server
            .create_database(&format!("pgonce_{purpose}"))
            .await
            .with_context(|| format!("on {}", server.address()))?;
        let pool = database.pool(max_connections).await?;
        pgonce::migrate(&pool)
            .await
            .context("applying migrations")?;
        Ok(RunDatabase {
            server: None,
            throwaway: server.is_throwaway(),
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
        Environment::read(&self.pool, self.throwaway).await
    }

    /// Drops the scratch database and stops a throwaway cluster opened for
    /// this run.
    pub async fn close(mut self) -> anyhow::Result<()> {
        self.pool.close().await;
        match self.server.as_mut() {
            Some(server) if server.is_throwaway() => server.shutdown(),
            _ => self.database.clone().drop_database().await?,
        }
        Ok(())
    }
}
