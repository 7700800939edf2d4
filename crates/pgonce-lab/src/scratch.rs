//! The database a `race`, `bench` or `demo` run works in: a scratch database
//! created for the run on the `--database-url` server, or on a throwaway
//! cluster when none is given; migrated, and dropped at the end, on every
//! exit path: [`RunDatabase::close`], an error, a panic, or Ctrl-C (the
//! command's future dropped) all drop it. Tests open one on the test
//! process's shared server ([`RunDatabase::for_tests`]).

use std::sync::{Arc, Mutex};

use anyhow::Context;
use pgonce_testkit::{ScratchDatabase, Server, ShutdownMode, shared_for_tests};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use crate::report::Environment;

/// A run's scratch database, migrated, on the server the run opened
/// (`DATABASE_URL` or a throwaway cluster), and the pool the run uses. It
/// is dropped on every exit path: by [`RunDatabase::close`], or on drop.
pub struct RunDatabase {
    /// The server opened for this run; `None` on the tests' shared server,
    /// which outlives the run (so its scratch database is always dropped).
    server: Option<Arc<Mutex<Server>>>,
    throwaway: bool,
    /// `None` once dropped.
    database: Option<ScratchDatabase>,
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
        run.server = Some(Arc::new(Mutex::new(server)));
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
        // From here on the database is ours to drop, whatever happens next:
        // an error, or this future dropped by a signal while the pool
        // connects (a scratch database was left behind so). Until the run
        // owns it, the guard drops it.
        let unclaimed = Unclaimed(Some(database));
        let pool = unclaimed
            .0
            .as_ref()
            .expect("held")
            .pool(max_connections)
            .await?;
        let db = RunDatabase {
            server: None,
            throwaway: server.is_throwaway(),
            database: unclaimed.claim(),
            pool,
        };
        pgonce::migrate(&db.pool)
            .await
            .context("applying migrations")?;
        Ok(db)
    }

    /// The run's pool on the scratch database, of `open`'s `max_connections`.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The scratch database's name.
    pub fn name(&self) -> &str {
        self.database.as_ref().map_or("", |d| d.name())
    }

    /// Options for the scratch database, for sessions of its own.
    pub(crate) fn options(&self) -> PgConnectOptions {
        self.database
            .as_ref()
            .expect("the database is open")
            .options()
    }

    pub(crate) async fn environment(&self) -> anyhow::Result<Environment> {
        Environment::read(&self.pool, self.throwaway).await
    }

    /// Restarts the throwaway cluster the run works on (`pg_ctl restart -m
    /// fast`), blocking until it is ready again. `None` on an external
    /// server, which is not the run's to restart.
    pub fn restarter(&self) -> Option<Restarter> {
        if !self.throwaway {
            return None;
        }
        let server = self.server.clone()?;
        Some(Box::new(move || {
            let mut server = server.lock().unwrap_or_else(|p| p.into_inner());
            match server.restart(ShutdownMode::Fast) {
                Some(r) => r.context("restarting the throwaway cluster"),
                None => anyhow::bail!("the server is not a throwaway cluster"),
            }
        }))
    }

    /// Drops the scratch database and stops a throwaway cluster.
    pub async fn close(mut self) -> anyhow::Result<()> {
        self.pool.close().await;
        if let Some(database) = self.database.take()
            && self.outlives_server()
        {
            database.drop_database().await?;
        }
        if let Some(server) = &self.server {
            server.lock().unwrap_or_else(|p| p.into_inner()).shutdown();
        }
        Ok(())
    }

    /// True when the scratch database would outlive the run unless dropped:
    /// on an external server, or on the tests' shared cluster.
    fn outlives_server(&self) -> bool {
        !self.throwaway || self.server.is_none()
    }
}

/// Restarts the run's server; see [`RunDatabase::restarter`].
pub(crate) type Restarter = Box<dyn FnOnce() -> anyhow::Result<()> + Send>;

impl Drop for RunDatabase {
    /// The exit paths that skip [`RunDatabase::close`] (an error, a panic,
    /// Ctrl-C dropping the run's future): drop the scratch database of an
    /// external server here. Drop cannot await, and may run on the runtime's
    /// own thread, so a thread of its own with a runtime of its own does it.
    /// A throwaway cluster needs nothing: dropping it removes it.
    fn drop(&mut self) {
        if !self.outlives_server() {
            return;
        }
        if let Some(database) = self.database.take() {
            drop_blocking(database);
        }
    }
}

/// A scratch database created and not yet owned by a [`RunDatabase`]:
/// dropped with it unless claimed.
struct Unclaimed(Option<ScratchDatabase>);

impl Unclaimed {
    fn claim(mut self) -> Option<ScratchDatabase> {
        self.0.take()
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if let Some(database) = self.0.take() {
            drop_blocking(database);
        }
    }
}

/// Drops `database` from a `Drop`, which cannot await and may run on the
/// runtime's own thread: a thread of its own with a runtime of its own does
/// it.
fn drop_blocking(database: ScratchDatabase) {
    let name = database.name().to_owned();
    let dropped = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?
            .block_on(database.drop_database())
            .map_err(|e| e.to_string())
    })
    .join();
    match dropped {
        Ok(Ok(())) => tracing::info!(database = name, "scratch database dropped"),
        Ok(Err(e)) => eprintln!("pgonce: could not drop scratch database {name}: {e}"),
        Err(_) => eprintln!("pgonce: could not drop scratch database {name}"),
    }
}
