//! The server tests, races and benchmarks run against: the one `DATABASE_URL`
//! names, or a throwaway [`Cluster`] when it names none; and fresh databases
//! on it, one per test or per run.

use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

use crate::cluster::{Cluster, ClusterError};
use crate::pooler::Pooler;

/// How long a first connection may take before the server counts as
/// unreachable. Short, so a wrong address fails fast and says so.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why no server could be reached or prepared.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// `DATABASE_URL` could not be parsed.
    #[error("DATABASE_URL is not a valid PostgreSQL URL: {0}")]
    BadUrl(#[source] sqlx::Error),
    /// The server did not accept a connection.
    #[error("cannot connect to PostgreSQL at {address}: {reason}")]
    Unreachable {
        /// `host:port` (or the socket directory) tried.
        address: String,
        /// Why the connection failed.
        reason: String,
    },
    /// The throwaway cluster could not be set up.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A statement on the server failed (creating or dropping a database).
    #[error("database error while {doing}: {source}")]
    Database {
        /// What the server was asked to do.
        doing: &'static str,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
}

/// A PostgreSQL server: an external one, or a throwaway cluster we own.
#[derive(Debug)]
pub struct Server {
    /// Options for the server's maintenance database; other databases are
    /// reached by changing the database name.
    options: PgConnectOptions,
    cluster: Option<Cluster>,
}

impl Server {
    /// The server `database_url` names, or, when it is `None`, a new
    /// throwaway cluster (stopped and removed when the `Server` drops).
    pub async fn open(database_url: Option<&str>) -> Result<Server, ServerError> {
        match database_url {
            Some(url) => Server::external(url).await,
            None => {
                let cluster = tokio::task::spawn_blocking(Cluster::start)
                    .await
                    .expect("cluster start does not panic")?;
                Server::throwaway(cluster)
            }
        }
    }

    /// Connects to an existing server and checks that it answers.
    pub async fn external(url: &str) -> Result<Server, ServerError> {
        let options = PgConnectOptions::from_str(url).map_err(ServerError::BadUrl)?;
        check_reachable(&options).await?;
        Ok(Server {
            options,
            cluster: None,
        })
    }

    fn throwaway(cluster: Cluster) -> Result<Server, ServerError> {
        let options =
            PgConnectOptions::from_str(&cluster.url("postgres")).map_err(ServerError::BadUrl)?;
        Ok(Server {
            options,
            cluster: Some(cluster),
        })
    }

    /// True when this server is a throwaway cluster of ours.
    pub fn is_throwaway(&self) -> bool {
        self.cluster.is_some()
    }

    /// Options for the database the server was opened with.
    pub fn options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// Where the server is, for messages: `host:port/database`.
    pub fn address(&self) -> String {
        address(&self.options)
    }

    /// Creates a new, empty database with a unique name starting with
    /// `prefix` and returns a handle that can drop it again.
    pub async fn create_database(&self, prefix: &str) -> Result<ScratchDatabase, ServerError> {
        let name = format!(
            "{prefix}_{}",
            uuid::Uuid::new_v4()
                .simple()
                .to_string()
                .get(..12)
                .unwrap_or("0")
        );
        let mut admin = self.admin().await?;
        // The name is ours (prefix from code, hex suffix), quoted anyway.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut admin)
            .await
            .map_err(|source| ServerError::Database {
                doing: "creating a scratch database",
                source,
            })?;
        let _ = admin.close().await;
        Ok(ScratchDatabase {
            options: self.options.clone().database(&name),
            admin: self.options.clone(),
            name,
        })
    }

    async fn admin(&self) -> Result<PgConnection, ServerError> {
        connect(&self.options).await
    }

    /// Restarts a throwaway cluster (see [`Cluster::restart`]); `None` for
    /// an external server, which is not ours to restart. Blocks until the
    /// server is ready again.
    pub fn restart(&mut self, mode: crate::ShutdownMode) -> Option<Result<(), ServerError>> {
        let cluster = self.cluster.as_mut()?;
        Some(cluster.restart(mode).map_err(ServerError::from))
    }

    /// Stops a throwaway cluster now (rather than at drop). Does nothing for
    /// an external server.
    pub fn shutdown(&mut self) {
        if let Some(mut cluster) = self.cluster.take() {
            cluster.stop();
        }
    }
}

/// `host:port/database` of `options`, for messages.
pub fn address(options: &PgConnectOptions) -> String {
    format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("")
    )
}

/// Opens one connection, failing within [`CONNECT_TIMEOUT`] with an error
/// that names the address.
pub async fn connect(options: &PgConnectOptions) -> Result<PgConnection, ServerError> {
    let unreachable = |reason: String| ServerError::Unreachable {
        address: address(options),
        reason,
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, options.connect()).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(unreachable(e.to_string())),
        Err(_) => Err(unreachable(format!("no answer within {CONNECT_TIMEOUT:?}"))),
    }
}

async fn check_reachable(options: &PgConnectOptions) -> Result<(), ServerError> {
    let conn = connect(options).await?;
    let _ = conn.close().await;
    Ok(())
}

/// A database created for one test or one run.
#[derive(Debug, Clone)]
pub struct ScratchDatabase {
    name: String,
    options: PgConnectOptions,
    admin: PgConnectOptions,
}

impl ScratchDatabase {
    /// The database's name on its server (unique: a prefix and a random
    /// suffix), which a pooler also routes by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connection options for this database.
    pub fn options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// A pool on this database with at most `max` connections.
    pub async fn pool(&self, max: u32) -> Result<PgPool, ServerError> {
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(self.options.clone())
            .await
            .map_err(|e| ServerError::Unreachable {
                address: address(&self.options),
                reason: e.to_string(),
            })
    }

    /// Drops the database, disconnecting whoever is still on it.
    pub async fn drop_database(self) -> Result<(), ServerError> {
        let mut admin = connect(&self.admin).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
            self.name
        )))
        .execute(&mut admin)
        .await
        .map_err(|source| ServerError::Database {
            doing: "dropping a scratch database",
            source,
        })?;
        let _ = admin.close().await;
        Ok(())
    }
}

/// The server every test in this process shares: `DATABASE_URL` when set,
/// else one throwaway cluster started on first use. The cluster lives in a
/// `static`, which is never dropped; its watchdog removes it when the test
/// process exits.
pub fn shared_for_tests() -> Result<&'static Server, String> {
    static SHARED: OnceLock<Result<Server, String>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let url = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty());
            // A private runtime: the caller may be inside a current-thread
            // runtime, which must not be blocked on itself.
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(Server::open(url.as_deref()))
                    .map_err(|e| e.to_string())
            })
            .join()
            .expect("server start does not panic")
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// A fresh, empty database on the shared test server. Panics with the reason
/// when no server can be had: a test cannot go on without one.
pub async fn fresh_database() -> ScratchDatabase {
    let server = shared_for_tests().unwrap_or_else(|e| panic!("no PostgreSQL for tests: {e}"));
    server
        .create_database("pgonce_test")
        .await
        .unwrap_or_else(|e| panic!("cannot create a test database: {e}"))
}

/// A fresh database on the shared test server, `migrate` applied to it, and
/// a pool of at most `max` connections on it: what a test that needs a
/// schema starts from. `migrate` is the crate's own (`pgonce::migrate`,
/// `pgonce_incidents::migrate`), run once before the test gets the pool;
/// the test kit knows no schema. Panics with the reason when there is no
/// server, or when the migration fails: a test cannot go on without either.
pub async fn fresh_migrated_database<E: std::fmt::Display>(
    max: u32,
    migrate: impl AsyncFnOnce(&PgPool) -> Result<(), E>,
) -> (ScratchDatabase, PgPool) {
    let database = fresh_database().await;
    let pool = fresh_pool(&database, max).await;
    migrate(&pool)
        .await
        .unwrap_or_else(|e| panic!("cannot migrate a test database: {e}"));
    (database, pool)
}

/// A throwaway cluster of the test's own, to stop or restart (started off
/// the runtime's thread: it blocks for a second or two), `migrate` applied
/// to its `postgres` database, and a pool of at most `max` connections on
/// it whose acquires give up after `acquire_timeout`: sqlx retries a
/// refused connection until then, so that is how long an acquire takes
/// once the server is stopped. Panics with the reason when the cluster
/// cannot start or the migration fails.
pub async fn own_migrated_cluster<E: std::fmt::Display>(
    max: u32,
    acquire_timeout: Duration,
    migrate: impl AsyncFnOnce(&PgPool) -> Result<(), E>,
) -> (Cluster, PgPool) {
    let cluster = tokio::task::spawn_blocking(Cluster::start)
        .await
        .expect("the cluster's start does not panic")
        .unwrap_or_else(|e| panic!("cannot start a cluster: {e}"));
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(acquire_timeout)
        .connect(&cluster.url("postgres"))
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the cluster: {e}"));
    migrate(&pool)
        .await
        .unwrap_or_else(|e| panic!("cannot migrate the cluster's database: {e}"));
    (cluster, pool)
}

/// PgBouncer in transaction mode in front of the shared test server
/// ([`shared_for_tests`]), started on first use and stopped by its watchdog
/// when the test process exits.
pub fn shared_pooler_for_tests() -> Result<&'static Pooler, String> {
    static POOLER: OnceLock<Result<Pooler, String>> = OnceLock::new();
    POOLER
        .get_or_init(|| {
            let server = shared_for_tests()?;
            Pooler::start(server.options()).map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// A fresh, empty database on the shared test server, and the options that
/// reach it through the shared pooler. Migrate over the database's own
/// options (a direct connection), run the code under test over the pooler's.
pub async fn fresh_database_behind_pooler() -> (ScratchDatabase, PgConnectOptions) {
    let database = fresh_database().await;
    let pooler =
        shared_pooler_for_tests().unwrap_or_else(|e| panic!("no PgBouncer for tests: {e}"));
    let options = pooler.options(database.name());
    (database, options)
}

/// [`fresh_migrated_database`] behind the shared pooler: `migrate` runs over
/// a direct connection (a migration is not what a pooler test is about),
/// and the pool of at most `max` connections goes through PgBouncer in
/// transaction mode, so every statement of the code under test may land on
/// another server connection.
pub async fn fresh_migrated_database_behind_pooler<E: std::fmt::Display>(
    max: u32,
    migrate: impl AsyncFnOnce(&PgPool) -> Result<(), E>,
) -> (ScratchDatabase, PgPool) {
    let (database, through_pooler) = fresh_database_behind_pooler().await;
    let direct = fresh_pool(&database, 1).await;
    migrate(&direct)
        .await
        .unwrap_or_else(|e| panic!("cannot migrate a test database: {e}"));
    direct.close().await;
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(through_pooler)
        .await
        .unwrap_or_else(|e| panic!("cannot connect through the pooler: {e}"));
    (database, pool)
}

async fn fresh_pool(database: &ScratchDatabase, max: u32) -> PgPool {
    database
        .pool(max)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to a test database: {e}"))
}

/// The tables and functions a schema holds, each name once, sorted: what
/// a test compares with the list a crate keeps of what its migrations make.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SchemaCatalog {
    /// Its ordinary tables.
    pub tables: Vec<String>,
    /// Its functions, by name (overloads once).
    pub functions: Vec<String>,
}

/// [`SchemaCatalog`] of `schema` in `pool`'s database.
pub async fn schema_catalog(pool: &PgPool, schema: &str) -> Result<SchemaCatalog, sqlx::Error> {
    sqlx::query_as(include_str!("sql/schema_catalog.sql"))
        .bind(schema)
        .fetch_one(pool)
        .await
}
