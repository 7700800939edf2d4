//! What a connection pooler set up wrongly for pgonce looks like, told
//! apart from every other database error in one place ([`PoolerProblem::of`]),
//! so that a caller gets [`Error::Pooler`](crate::Error::Pooler) naming the
//! cause and the fix instead of an opaque database or protocol error.
//!
//! pgonce is tested behind PgBouncer 1.21 or newer in `pool_mode =
//! transaction` with `max_prepared_statements` set and LISTEN routed around
//! the pooler ([`Listen::Direct`](crate::Listen::Direct) or
//! [`Listen::Off`](crate::Listen::Off)). Each way of missing that set-up
//! shows as its own error:
//!
//! * no `max_prepared_statements` (or a PgBouncer older than 1.21): sqlx's
//!   named statements (`sqlx_s_1`, ...) are prepared on one server
//!   connection and used on another: `prepared statement "sqlx_s_1" already
//!   exists` (42P05), `... does not exist` (26000), or `bind message
//!   supplies 1 parameters, but prepared statement "sqlx_s_1" requires 2`
//!   (08P01: the server connection holds another client's statement of
//!   that name). When that other statement takes the same parameters,
//!   nothing fails: it runs in place of the one asked for. So this
//!   misconfiguration is not always seen, and must be avoided, not relied
//!   on to be reported;
//! * LISTEN on a pooled connection ([`Listen::Pool`](crate::Listen::Pool)):
//!   the server connection that listened later serves another client, and
//!   the notification reaches that client as a protocol message it did not
//!   expect (`NotificationResponse`);
//! * PgBouncer refusing a client itself (SQLSTATE 08P01 with its own text):
//!   a startup parameter it does not know (`unsupported startup
//!   parameter`), more clients than `max_client_conn`, or no server
//!   connection it could open.
//!
//! The matching is on PgBouncer's and sqlx's texts, which are stable across
//! their releases (PgBouncer's error texts have not changed since 1.7).

use std::fmt;

/// A pooler between pgonce and PostgreSQL that is not set up the way pgonce
/// needs; each names its cause ([`PoolerProblem::cause`]) and its fix
/// ([`PoolerProblem::fix`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolerProblem {
    /// sqlx's named prepared statements met a server connection that did
    /// not prepare them, or had prepared one of the same name for another
    /// client: a transaction-mode pooler without `max_prepared_statements`.
    /// Seen only when the names clash in a way PostgreSQL refuses: another
    /// client's statement of the same name and parameters runs instead,
    /// without an error.
    PreparedStatements,
    /// A notification arrived where a query's answer was expected: LISTEN
    /// ran on a pooled server connection that now serves this client.
    /// The statement's outcome is unknown: the notification may come after
    /// its commit (a send answers this error with its message stored), so
    /// a caller that retries on it may do the work twice. Only some
    /// statements meet it, at random: set LISTEN up as
    /// [`PoolerProblem::fix`] says rather than retry.
    Notifications,
    /// PgBouncer refused a startup parameter sqlx sends
    /// (`extra_float_digits`, `options`).
    StartupParameter,
    /// PgBouncer refused the client: `max_client_conn` (or a per-database
    /// or per-user client limit) reached.
    ClientLimit,
    /// PgBouncer could not open or log in a server connection.
    ServerUnreachable,
}

/// SQLSTATE `duplicate_prepared_statement`.
const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";
/// SQLSTATE `invalid_sql_statement_name` (no such prepared statement).
const INVALID_SQL_STATEMENT_NAME: &str = "26000";
/// SQLSTATE `protocol_violation`: every error PgBouncer raises itself, and
/// PostgreSQL's refusal of a Bind whose parameters do not fit the prepared
/// statement of that name.
const PROTOCOL_VIOLATION: &str = "08P01";
/// PostgreSQL's text when a Bind supplies another number of parameters
/// than the prepared statement it names takes.
const BIND_MISMATCH: &str = "bind message supplies";
/// The prefix of the names sqlx gives its prepared statements.
const SQLX_STATEMENT: &str = "\"sqlx_s_";

/// PgBouncer's own texts (08P01), by problem.
const PGBOUNCER_TEXTS: [(&str, PoolerProblem); 5] = [
    (
        "unsupported startup parameter",
        PoolerProblem::StartupParameter,
    ),
    ("no more connections allowed", PoolerProblem::ClientLimit),
    ("client connections exceeded", PoolerProblem::ClientLimit),
    (
        "pgbouncer cannot connect to server",
        PoolerProblem::ServerUnreachable,
    ),
    (
        "server login has been failing",
        PoolerProblem::ServerUnreachable,
    ),
];

impl PoolerProblem {
    /// The pooler problem `e` shows, if it shows one: the one place pooler
    /// errors are recognised.
    pub fn of(e: &sqlx::Error) -> Option<PoolerProblem> {
        match e {
            sqlx::Error::Protocol(text) if text.contains("NotificationResponse") => {
                Some(PoolerProblem::Notifications)
            }
            sqlx::Error::Database(d) => {
                let code = d.code()?;
                let message = d.message();
                match &*code {
                    DUPLICATE_PREPARED_STATEMENT | INVALID_SQL_STATEMENT_NAME
                        if message.contains(SQLX_STATEMENT) =>
                    {
                        Some(PoolerProblem::PreparedStatements)
                    }
                    PROTOCOL_VIOLATION
                        if message.contains(BIND_MISMATCH) && message.contains(SQLX_STATEMENT) =>
                    {
                        Some(PoolerProblem::PreparedStatements)
                    }
                    PROTOCOL_VIOLATION => PGBOUNCER_TEXTS
                        .iter()
                        .find(|(text, _)| message.contains(text))
                        .map(|(_, problem)| *problem),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// What is wrong, in a few words.
    pub fn cause(self) -> &'static str {
        match self {
            PoolerProblem::PreparedStatements => {
                "the pooler does not carry prepared statements between server connections"
            }
            PoolerProblem::Notifications => {
                "a LISTEN notification reached a pooled connection (LISTEN through a \
                 transaction-mode pooler)"
            }
            PoolerProblem::StartupParameter => {
                "the pooler refused a startup parameter the client sends"
            }
            PoolerProblem::ClientLimit => "the pooler refused another client connection",
            PoolerProblem::ServerUnreachable => "the pooler cannot connect to PostgreSQL",
        }
    }

    /// How to set it right.
    pub fn fix(self) -> &'static str {
        match self {
            PoolerProblem::PreparedStatements => {
                "set max_prepared_statements (PgBouncer 1.21 or newer), or use pool_mode = session"
            }
            PoolerProblem::Notifications => {
                "listen over a direct connection (Listen::Direct, database.direct_url) or not \
                 at all (Listen::Off, database.listen = false), or use pool_mode = session"
            }
            PoolerProblem::StartupParameter => {
                "add it to PgBouncer's ignore_startup_parameters (extra_float_digits,options)"
            }
            PoolerProblem::ClientLimit => {
                "raise PgBouncer's max_client_conn, or lower the pools' max_connections"
            }
            PoolerProblem::ServerUnreachable => {
                "check the server named in PgBouncer's [databases] entry and PgBouncer's log"
            }
        }
    }
}

impl fmt::Display for PoolerProblem {
    /// The cause; [`Error::Pooler`](crate::Error::Pooler) adds the fix.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.cause())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;
    use std::error::Error as StdError;

    /// A server error with `code` and `message`, as sqlx hands it over.
    #[derive(Debug)]
    struct ServerError {
        code: &'static str,
        message: &'static str,
    }

    impl fmt::Display for ServerError {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.message)
        }
    }

    impl StdError for ServerError {}

    impl sqlx::error::DatabaseError for ServerError {
        fn message(&self) -> &str {
            self.message
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.code))
        }
        fn as_error(&self) -> &(dyn StdError + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn StdError + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn StdError + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn server(code: &'static str, message: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(ServerError { code, message }))
    }

    #[test]
    fn each_misconfiguration_is_told_apart() {
        let cases = [
            (
                server("42P05", "prepared statement \"sqlx_s_1\" already exists"),
                Some(PoolerProblem::PreparedStatements),
            ),
            (
                server("26000", "prepared statement \"sqlx_s_7\" does not exist"),
                Some(PoolerProblem::PreparedStatements),
            ),
            (
                server(
                    "08P01",
                    "bind message supplies 1 parameters, but prepared statement \"sqlx_s_1\" \
                     requires 2",
                ),
                Some(PoolerProblem::PreparedStatements),
            ),
            (
                sqlx::Error::Protocol("execute: unexpected message: NotificationResponse".into()),
                Some(PoolerProblem::Notifications),
            ),
            (
                server("08P01", "unsupported startup parameter: extra_float_digits"),
                Some(PoolerProblem::StartupParameter),
            ),
            (
                server("08P01", "no more connections allowed (max_client_conn)"),
                Some(PoolerProblem::ClientLimit),
            ),
            (
                server("08P01", "pgbouncer cannot connect to server"),
                Some(PoolerProblem::ServerUnreachable),
            ),
        ];
        for (error, expected) in cases {
            assert_eq!(PoolerProblem::of(&error), expected, "{error}");
        }
    }

    #[test]
    fn the_same_codes_without_a_pooler_are_not_pooler_problems() {
        // A prepared statement of the application's own, a protocol error
        // of another kind, a server's 08P01.
        let cases = [
            server("42P05", "prepared statement \"mine\" already exists"),
            server("26000", "prepared statement \"mine\" does not exist"),
            server(
                "08P01",
                "bind message supplies 1 parameters, but prepared statement \"mine\" requires 2",
            ),
            sqlx::Error::Protocol("execute: unexpected message: DataRow".into()),
            server("08P01", "invalid frontend message type 0"),
            sqlx::Error::RowNotFound,
        ];
        for error in cases {
            assert_eq!(PoolerProblem::of(&error), None, "{error}");
        }
    }
}
