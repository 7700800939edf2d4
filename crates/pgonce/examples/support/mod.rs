//! What every example shares: a database of its own to run in, with
//! pgonce's schema applied. Not part of any pattern; in a service the pool
//! comes from its configuration and `pgonce::migrate` runs at startup.

use pgonce_testkit::{ScratchDatabase, Server};
use sqlx::PgPool;

/// The examples' error type: any error, sendable across tasks.
pub type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A scratch database and the server it lives on.
pub struct Scratch {
    pub pool: PgPool,
    db: ScratchDatabase,
    server: Server,
}

/// Creates a fresh database for the example `name` and applies pgonce's
/// migrations: on the server `DATABASE_URL` names (the role needs
/// `CREATEDB`), or, without one, on a throwaway cluster started from the
/// installed PostgreSQL binaries and removed at the end.
pub async fn scratch(name: &str) -> Result<Scratch> {
    let url = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty());
    let server = Server::open(url.as_deref()).await?;
    let db = server
        .create_database(&format!("pgonce_example_{name}"))
        .await?;
    let pool = db.pool(8).await?;
    pgonce::migrate(&pool).await?;
    println!(
        "database {} on {} ({})",
        db.name(),
        server.address(),
        if server.is_throwaway() {
            "throwaway cluster"
        } else {
            "DATABASE_URL"
        }
    );
    Ok(Scratch { pool, db, server })
}

impl Scratch {
    /// Closes the pool, drops the database and stops a throwaway cluster.
    pub async fn finish(mut self) -> Result {
        self.pool.close().await;
        self.db.drop_database().await?;
        self.server.shutdown();
        Ok(())
    }
}
