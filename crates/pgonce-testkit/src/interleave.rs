//! Step-by-step interleaving of several database sessions, for race tests and
//! `pgonce race`.
//!
//! Each [`Session`] is a one-connection pool whose backend carries a unique
//! `application_name`, so the harness can find it in `pg_stat_activity` even
//! when the code under test checks the connection out itself. A step either
//! runs to completion ([`Interleaving::step`]) or is expected to block
//! ([`Interleaving::step_blocks`]): the harness then starts it in a task and
//! waits until PostgreSQL reports that backend as waiting on a lock held by
//! another (`pg_blocking_pids`), and fails loudly if that does not happen in
//! time or the step finishes instead. [`Interleaving::try_step`] and
//! [`Blocked::try_resume`] fold a step's own error into [`HarnessError`], so
//! a step that must succeed costs one `?`. No step relies on a sleep to order
//! events; the only waiting is polling the server for a state to appear.
//!
//! ```no_run
//! # async fn demo(options: sqlx::postgres::PgConnectOptions) -> Result<(), pgonce_testkit::HarnessError> {
//! use pgonce_testkit::Interleaving;
//! let race = Interleaving::new(options).await?;
//! let a = race.session("A").await?;
//! let b = race.session("B").await?;
//! let mut tx_a = race.try_step(&a, "BEGIN", a.pool().begin()).await?;
//! race.try_step(&a, "lock 42", sqlx::query("SELECT pg_advisory_xact_lock(42)").execute(&mut *tx_a)).await?;
//! let pool_b = b.pool().clone();
//! let waiting = race
//!     .step_blocks(&b, "lock 42", async move {
//!         let mut tx = pool_b.begin().await?;
//!         sqlx::query("SELECT pg_advisory_xact_lock(42)").execute(&mut *tx).await?;
//!         tx.commit().await
//!     })
//!     .await?;
//! assert_eq!(waiting.blocked_by(), ["A"]);
//! race.try_step(&a, "COMMIT", tx_a.commit()).await?;
//! waiting.try_resume().await?;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::task::JoinHandle;

/// How long a step may take, and how long a step expected to block may take
/// to be seen blocked, unless [`Interleaving::with_timeout`] says otherwise.
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the server is asked whether a session is blocked yet.
const POLL_EVERY: Duration = Duration::from_millis(2);

/// What went wrong in driving an interleaving. Every variant names the
/// session and step, so a failing race test says which step broke.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// A step run with [`Interleaving::step_blocks`] finished instead of
    /// waiting for a lock: the race did not happen as written.
    #[error("session {session}: step `{step}` was expected to block on a lock, but it finished")]
    DidNotBlock {
        /// The session's name.
        session: String,
        /// The step's description.
        step: String,
    },
    /// A step expected to block was neither seen waiting for a lock nor
    /// finished within the harness's timeout.
    #[error("session {session}: step `{step}` was not seen blocked within {waited:?}")]
    NotBlocked {
        /// The session's name.
        session: String,
        /// The step's description.
        step: String,
        /// How long the harness watched for it.
        waited: Duration,
    },
    /// A blocked step stopped waiting for its lock before it had waited as
    /// long as [`Blocked::still_waiting_after`] was told.
    #[error("session {session}: step `{step}` stopped waiting before {millis} ms: {outcome}")]
    StoppedWaiting {
        /// The session's name.
        session: String,
        /// The step's description.
        step: String,
        /// How long it was to wait, at least.
        millis: i32,
        /// What the step returned, as debug text.
        outcome: String,
    },
    /// A step (or a resumed blocked step) did not finish within the
    /// harness's timeout: a deadlock in the scenario, or a lock nobody
    /// releases.
    #[error("session {session}: step `{step}` did not finish within {waited:?}")]
    StepTimeout {
        /// The session's name.
        session: String,
        /// The step's description.
        step: String,
        /// How long the harness waited.
        waited: Duration,
    },
    /// A step's future panicked in the task the harness ran it in.
    #[error("session {session}: step `{step}` panicked")]
    StepPanicked {
        /// The session's name.
        session: String,
        /// The step's description.
        step: String,
    },
    /// A step run with [`Interleaving::try_step`] (or resumed with
    /// [`Blocked::try_resume`]) returned an error of its own.
    #[error("session {session}: step `{step}` failed: {source}")]
    StepFailed {
        /// The session's name.
        session: String,
        /// The step's description.
        step: String,
        /// The step's own error.
        #[source]
        source: BoxError,
    },
    /// The harness's own query (opening a session, watching `pg_locks`)
    /// failed.
    #[error("harness database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// Any error a step's future may return, boxed: what
/// [`HarnessError::StepFailed`] carries, and what a race test can return so
/// that one `?` serves harness, `sqlx` and `pgonce` errors alike.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// One entry of the timeline an interleaving records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// 0, 1, 2, ... in the order the harness saw the events.
    pub at: usize,
    /// The session the step ran in.
    pub session: String,
    /// The step's description, as the scenario gave it.
    pub what: String,
    /// What happened to the step.
    pub event: StepEvent,
}

/// What happened to a step, in the order the harness saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepEvent {
    /// The step ran to completion.
    Ran,
    /// The step was seen waiting for a lock held by these sessions.
    Blocked {
        /// The blockers: session names, or `pid N` for other backends.
        by: Vec<String>,
    },
    /// A step that was blocked finished.
    Resumed,
    /// A remark added by the scenario (`Interleaving::note`).
    Note,
}

/// A set of named sessions driven one step at a time.
#[derive(Debug, Clone)]
pub struct Interleaving {
    observer: PgPool,
    options: PgConnectOptions,
    prefix: String,
    timeout: Duration,
    timeline: Arc<Mutex<Vec<Step>>>,
}

/// One named participant: a pool of exactly one connection whose backend is
/// tagged with a unique `application_name`.
#[derive(Debug, Clone)]
pub struct Session {
    name: String,
    application_name: String,
    pool: PgPool,
}

impl Session {
    /// The name the scenario gave the session (`A`, `B`...), as the
    /// timeline and the blockers name it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The session's pool (one connection). Hand it to the code under test.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Sets `setting` to `value` for the rest of the session, as a role's
    /// or database's setting (`ALTER ROLE ... SET`) gives every new one.
    pub async fn set(&self, setting: &str, value: &str) -> Result<(), HarnessError> {
        sqlx::query("SELECT set_config($1, $2, false)")
            .bind(setting)
            .bind(value)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

impl Interleaving {
    /// A harness on the database `options` points to.
    pub async fn new(options: PgConnectOptions) -> Result<Interleaving, HarnessError> {
        let observer = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone().application_name("pgonce-observer"))
            .await?;
        let prefix = format!(
            "pgonce-race-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        Ok(Interleaving {
            observer,
            options,
            prefix,
            timeout: DEFAULT_STEP_TIMEOUT,
            timeline: Arc::default(),
        })
    }

    /// Changes the step timeout (default [`DEFAULT_STEP_TIMEOUT`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Opens a named session. Names must be unique within the harness.
    pub async fn session(&self, name: &str) -> Result<Session, HarnessError> {
        let application_name = format!("{}:{name}", self.prefix);
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(self.timeout)
            .connect_with(self.options.clone().application_name(&application_name))
            .await?;
        Ok(Session {
            name: name.to_string(),
            application_name,
            pool,
        })
    }

    /// Runs one step of `session` to completion and records it.
    pub async fn step<T>(
        &self,
        session: &Session,
        what: &str,
        step: impl Future<Output = T>,
    ) -> Result<T, HarnessError> {
        let out = tokio::time::timeout(self.timeout, step)
            .await
            .map_err(|_| HarnessError::StepTimeout {
                session: session.name.clone(),
                step: what.to_string(),
                waited: self.timeout,
            })?;
        self.record(session, what, StepEvent::Ran);
        Ok(out)
    }

    /// Runs one fallible step of `session` to completion and records it; an
    /// error the step returns becomes [`HarnessError::StepFailed`], naming
    /// the session and step, so a test writes one `?` for both the harness
    /// and the step. For a step whose error is an expected outcome, use
    /// [`Interleaving::step`] and look at the `Result` it returns.
    pub async fn try_step<T, E: Into<BoxError>>(
        &self,
        session: &Session,
        what: &str,
        step: impl Future<Output = Result<T, E>>,
    ) -> Result<T, HarnessError> {
        self.step(session, what, step)
            .await?
            .map_err(|e| HarnessError::StepFailed {
                session: session.name.clone(),
                step: what.to_string(),
                source: e.into(),
            })
    }

    /// Starts a step of `session` that must block on a lock, and returns once
    /// PostgreSQL shows its backend waiting. Fails if the step finishes
    /// first, or is not seen blocked within the timeout.
    pub async fn step_blocks<T: Send + 'static>(
        &self,
        session: &Session,
        what: &str,
        step: impl Future<Output = T> + Send + 'static,
    ) -> Result<Blocked<T>, HarnessError> {
        let handle = tokio::spawn(step);
        let started = Instant::now();
        loop {
            if handle.is_finished() {
                return Err(HarnessError::DidNotBlock {
                    session: session.name.clone(),
                    step: what.to_string(),
                });
            }
            if let Some(by) = self.blockers_of(session).await? {
                self.record(session, what, StepEvent::Blocked { by: by.clone() });
                return Ok(Blocked {
                    handle,
                    session: session.name.clone(),
                    what: what.to_string(),
                    blocked_by: by,
                    timeout: self.timeout,
                    timeline: self.clone(),
                });
            }
            if started.elapsed() >= self.timeout {
                handle.abort();
                return Err(HarnessError::NotBlocked {
                    session: session.name.clone(),
                    step: what.to_string(),
                    waited: self.timeout,
                });
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// Waits until `session`'s backend is blocked, for a step started some
    /// other way (for instance by a worker task). Returns who blocks it.
    pub async fn wait_until_blocked(
        &self,
        session: &Session,
        what: &str,
    ) -> Result<Vec<String>, HarnessError> {
        let started = Instant::now();
        loop {
            if let Some(by) = self.blockers_of(session).await? {
                self.record(session, what, StepEvent::Blocked { by: by.clone() });
                return Ok(by);
            }
            if started.elapsed() >= self.timeout {
                return Err(HarnessError::NotBlocked {
                    session: session.name.clone(),
                    step: what.to_string(),
                    waited: self.timeout,
                });
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// Whether the backend named `application_name` is still waiting for a
    /// lock once its statement has run `millis` by the server's clock;
    /// false as soon as it is seen not waiting (its statement ended or
    /// failed). The verdict comes from the server's own clock, not from
    /// how long the test slept.
    async fn waiting_longer_than(
        &self,
        application_name: &str,
        millis: i32,
    ) -> Result<bool, HarnessError> {
        loop {
            let waited_long: Option<bool> =
                sqlx::query_scalar(include_str!("sql/waited_longer_than.sql"))
                    .bind(application_name)
                    .bind(millis)
                    .fetch_optional(&self.observer)
                    .await?;
            match waited_long {
                None => return Ok(false),
                Some(true) => return Ok(true),
                Some(false) => tokio::time::sleep(POLL_EVERY).await,
            }
        }
    }

    /// Whether `session`'s backend is waiting on a lock right now, and on
    /// whom: session names for our sessions, `pid N` for any other backend.
    pub async fn blockers_of(
        &self,
        session: &Session,
    ) -> Result<Option<Vec<String>>, HarnessError> {
        let rows: Vec<Blocker> = sqlx::query_as(include_str!("sql/blockers.sql"))
            .bind(&session.application_name)
            .fetch_all(&self.observer)
            .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let prefix = format!("{}:", self.prefix);
        let mut names: Vec<String> = rows
            .into_iter()
            .map(
                |Blocker {
                     application_name,
                     blocker_pid,
                 }| match application_name
                    .as_deref()
                    .and_then(|a| a.strip_prefix(&prefix))
                {
                    Some(name) => name.to_string(),
                    None => format!("pid {blocker_pid}"),
                },
            )
            .collect();
        names.sort();
        names.dedup();
        Ok(Some(names))
    }

    /// Adds a remark to the timeline (an outcome worth showing in a table).
    pub fn note(&self, session: &Session, what: &str) {
        self.record(session, what, StepEvent::Note);
    }

    /// The steps recorded so far, in order.
    pub fn timeline(&self) -> Vec<Step> {
        self.timeline.lock().expect("timeline lock").clone()
    }

    fn record(&self, session: &Session, what: &str, event: StepEvent) {
        let mut timeline = self.timeline.lock().expect("timeline lock");
        let at = timeline.len();
        timeline.push(Step {
            at,
            session: session.name.clone(),
            what: what.to_string(),
            event,
        });
    }
}

impl<T, E: Into<BoxError>> Blocked<Result<T, E>> {
    /// [`Blocked::resume`] for a fallible step: an error the step returned
    /// becomes [`HarnessError::StepFailed`], so one `?` serves both.
    pub async fn try_resume(self) -> Result<T, HarnessError> {
        let (session, step) = (self.session.clone(), self.what.clone());
        self.resume().await?.map_err(|e| HarnessError::StepFailed {
            session,
            step,
            source: e.into(),
        })
    }
}

/// A step seen blocked. [`Blocked::resume`] waits for it to finish once the
/// scenario has released what it waited for.
#[derive(Debug)]
#[must_use = "a blocked step must be resumed, or its outcome is lost"]
pub struct Blocked<T> {
    handle: JoinHandle<T>,
    session: String,
    what: String,
    blocked_by: Vec<String>,
    timeout: Duration,
    timeline: Interleaving,
}

impl<T: std::fmt::Debug> Blocked<T> {
    /// The step, if it is still waiting for a lock once its statement has
    /// run `millis` by the server's clock: for a wait that must outlast a
    /// timeout. [`HarnessError::StoppedWaiting`], with the step's outcome,
    /// if it stopped waiting before.
    pub async fn still_waiting_after(self, millis: i32) -> Result<Blocked<T>, HarnessError> {
        let application_name = format!("{}:{}", self.timeline.prefix, self.session);
        if self
            .timeline
            .waiting_longer_than(&application_name, millis)
            .await?
        {
            return Ok(self);
        }
        let (session, step) = (self.session.clone(), self.what.clone());
        let outcome = format!("{:?}", self.resume().await);
        Err(HarnessError::StoppedWaiting {
            session,
            step,
            millis,
            outcome,
        })
    }

    /// [`Blocked::still_waiting_after`], then commits `holder`, the
    /// transaction the step waits for, as a step of `releaser`, and
    /// returns the step's output once it has finished.
    pub async fn outlasts_then_commit(
        self,
        millis: i32,
        releaser: &Session,
        holder: sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<T, HarnessError> {
        let waiting = self.still_waiting_after(millis).await?;
        let timeline = waiting.timeline.clone();
        timeline.step(releaser, "COMMIT", holder.commit()).await??;
        waiting.resume().await
    }
}

impl<T> Blocked<T> {
    /// The sessions (or `pid N`) the step was waiting for.
    pub fn blocked_by(&self) -> &[String] {
        &self.blocked_by
    }

    /// Gives the step up, as a caller whose client went away would: its
    /// future is dropped where it waits. What its session's connection is
    /// left with is for the scenario to check.
    pub fn cancel(self) {
        self.handle.abort();
        let mut timeline = self.timeline.timeline.lock().expect("timeline lock");
        let at = timeline.len();
        timeline.push(Step {
            at,
            session: self.session,
            what: format!("{} (cancelled)", self.what),
            event: StepEvent::Note,
        });
    }

    /// Waits for the step to finish and returns its output.
    pub async fn resume(self) -> Result<T, HarnessError> {
        let out = match tokio::time::timeout(self.timeout, self.handle).await {
            Err(_) => {
                return Err(HarnessError::StepTimeout {
                    session: self.session,
                    step: self.what,
                    waited: self.timeout,
                });
            }
            Ok(Err(_)) => {
                return Err(HarnessError::StepPanicked {
                    session: self.session,
                    step: self.what,
                });
            }
            Ok(Ok(out)) => out,
        };
        let mut timeline = self.timeline.timeline.lock().expect("timeline lock");
        let at = timeline.len();
        timeline.push(Step {
            at,
            session: self.session,
            what: self.what,
            event: StepEvent::Resumed,
        });
        Ok(out)
    }
}

/// A backend blocking a session, as `sql/blockers.sql` returns it: its
/// `application_name` (ours carry the harness's prefix) and its pid.
#[derive(sqlx::FromRow)]
struct Blocker {
    application_name: Option<String>,
    blocker_pid: i32,
}

/// A table locked `ACCESS EXCLUSIVE` by a transaction of its own, as a
/// migration or `VACUUM FULL` holds it: every statement that touches the
/// table waits until the lock is released. For a test whose subject
/// (a background loop, a process) starts its statements by itself: the
/// test waits until they are seen blocked by it
/// ([`TableLock::wait_until_blocking`]), then acts.
pub struct TableLock {
    holder: sqlx::Transaction<'static, sqlx::Postgres>,
    pid: i32,
}

impl TableLock {
    /// Locks `table` (a name SQL takes as written, `schema.table`) in a
    /// transaction on a connection of `pool`.
    pub async fn take(pool: &PgPool, table: &str) -> Result<TableLock, HarnessError> {
        let mut holder = pool.begin().await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *holder)
            .await?;
        // The table's name is the test's own, never input.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
        )))
        .execute(&mut *holder)
        .await?;
        Ok(TableLock { holder, pid })
    }

    /// Waits until `sessions` backends of `pool`'s server wait for this
    /// lock (seen in `pg_blocking_pids`); [`HarnessError::NotBlocked`]
    /// after `timeout`, which only ends a run that never gets there.
    pub async fn wait_until_blocking(
        &self,
        pool: &PgPool,
        sessions: i64,
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        let started = Instant::now();
        loop {
            let blocked: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(self.pid)
            .fetch_one(pool)
            .await?;
            if blocked >= sessions {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                return Err(HarnessError::NotBlocked {
                    session: format!("{sessions} waiting for backend {}", self.pid),
                    step: "a statement on the locked table".into(),
                    waited: timeout,
                });
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// Releases the lock (rolls its transaction back).
    pub async fn release(self) -> Result<(), HarnessError> {
        self.holder.rollback().await?;
        Ok(())
    }
}
