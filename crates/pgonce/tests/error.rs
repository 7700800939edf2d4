//! How a database error reads: PostgreSQL's message once, with its
//! SQLSTATE, whether printed alone or with its causes.

use pgonce::Error;
use pgonce_testkit::fresh_database;

/// The error and its causes as `anyhow`'s `{:#}` prints them.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text
}

#[tokio::test]
async fn a_database_error_prints_its_message_once() {
    let db = fresh_database().await;
    let pool = db.pool(1).await.unwrap();
    let e: Error = sqlx::query("SELECT * FROM pgonce_no_such_table")
        .execute(&pool)
        .await
        .unwrap_err()
        .into();
    let text = with_causes(&e);
    assert_eq!(
        text,
        "database error: relation \"pgonce_no_such_table\" does not exist (SQLSTATE 42P01)"
    );
    assert!(matches!(e, Error::Database(sqlx::Error::Database(_))));

    // A failed migration: the statement's error once, under the migration.
    sqlx::query("CREATE ROLE pgonce_error_test")
        .execute(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET ROLE pgonce_error_test")
        .execute(&mut *conn)
        .await
        .unwrap();
    let e = sqlx::query("CREATE SCHEMA pgonce_error_test_schema")
        .execute(&mut *conn)
        .await
        .unwrap_err();
    let e = Error::from(sqlx::migrate::MigrateError::Execute(e));
    let text = with_causes(&e);
    assert_eq!(text.matches("permission denied").count(), 1, "{text}");
    assert!(
        text.starts_with("database error: while executing migrations: permission denied"),
        "{text}"
    );
    assert!(!text.contains(" at line "), "{text}");
}
