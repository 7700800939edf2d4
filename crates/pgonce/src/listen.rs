//! Where LISTEN runs: the queue's long polls and the event store's
//! subscriptions wait for NOTIFY on a connection of their own.
//!
//! LISTEN is session state. Behind a transaction-mode pooler (PgBouncer
//! with `pool_mode = transaction`, RDS Proxy, Supavisor) it lands on a
//! pooled server connection, whose notifications then reach whichever
//! client gets that connection next, as protocol messages it does not
//! expect. There, listen over a direct connection, or not at all: every
//! waiter also polls on a timer, so notifications only make it faster.

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};

use crate::error::Result;

/// Where to LISTEN for notifications.
#[derive(Debug, Clone, Default)]
pub enum Listen {
    /// A connection opened with the pool's own connect options (outside
    /// the pool: it takes none of the pool's connections). Right when the
    /// pool reaches PostgreSQL directly or through a session-mode pooler.
    ///
    /// The pool's hooks (`PgPoolOptions::after_connect`,
    /// `before_acquire`) do not run on it: what they set (a `search_path`,
    /// a role, an `application_name`) is not set there. Nothing the
    /// listener does needs it: it runs `LISTEN` on a channel pgonce names
    /// (`pgonce_queue`, `pgonce_events`), which is not looked up in any
    /// schema and needs no privilege, and no other statement than `LISTEN`
    /// and `UNLISTEN` (sqlx's `PgListener`, when it lets go); the
    /// `pg_notify` calls run on the pool's connections, hooks and all.
    /// What the connect options carry does apply (their
    /// `application_name`, and settings given with
    /// `PgConnectOptions::options`): set there what the listener's
    /// session should show, or use [`Listen::Direct`] with options of its
    /// own.
    #[default]
    Pool,
    /// A connection opened with these options: a direct connection to the
    /// server, bypassing the transaction-mode pooler the pool goes through.
    Direct(Box<PgConnectOptions>),
    /// No listening: waiters poll on their timer only.
    Off,
}

impl Listen {
    /// A listener on `channel` as this setting says, or `None` for
    /// [`Listen::Off`].
    pub(crate) async fn listener(
        &self,
        pool: &PgPool,
        channel: &str,
    ) -> Result<Option<PgListener>> {
        // A pool of its own for this one connection, never the caller's:
        // PgListener reconnects through it after an error, and a reconnect
        // given up half way (its future dropped, as by a caller's timeout,
        // after the LISTEN was sent and before its answer was read) puts
        // the connection back in that pool still LISTENing. In the
        // caller's pool it would reach the application, whose statements
        // would then carry notifications nobody reads; in its own, only
        // the listener takes it again, and LISTENs on it again.
        let options = match self {
            Listen::Off => return Ok(None),
            Listen::Pool => (*pool.connect_options()).clone(),
            Listen::Direct(options) => (**options).clone(),
        };
        let own = PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(options);
        let mut listener = PgListener::connect_with(&own).await?;
        listener.listen(channel).await?;
        Ok(Some(listener))
    }
}
