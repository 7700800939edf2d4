//! Decide from events, then append under the decision's condition (pattern
//! P5, the conditional append of a DCB event store).
//!
//! Usernames are unique. To register one, a writer reads the events about
//! that username (the decision), and appends `UsernameClaimed` on the
//! condition that no such event was appended after the position it read
//! at. Two registrations of "alice" decide at the same time and both see the
//! name free; the first append commits, the second fails its condition and
//! writes nothing. An append about another username in between does not
//! get in anyone's way: the consistency boundary is one username.
//!
//! Run: `cargo run -p pgonce --example dcb_decision`.

mod support;

use pgonce::events::Decision;
use pgonce::{AppendCondition, Error, Event, EventStore, EventStoreConfig, Query};
use serde_json::json;
use support::Result;

/// The events a registration of `username` decides on.
fn about(username: &str) -> pgonce::Result<Query> {
    Query::item(["UsernameClaimed"], [format!("username:{username}")])
}

/// Appends the claim if the decision saw the name free and nothing about
/// it was appended since.
async fn register(
    store: &EventStore,
    username: &str,
    user: &str,
    decision: &Decision,
) -> pgonce::Result<bool> {
    if !decision.events.is_empty() {
        println!("{user}: {username:?} is taken, nothing to append");
        return Ok(false);
    }
    let claim = Event::new("UsernameClaimed")
        .tag(format!("username:{username}"))
        .data(json!({ "user": user }));
    // The condition: fail if an event the decision would have seen exists
    // after the position the decision was made at.
    let condition = AppendCondition::new(about(username)?, decision.after);
    match store.append(&[claim], Some(&condition)).await {
        Ok(appended) => {
            println!(
                "{user}: claimed {username:?} at position {:?}",
                appended.positions
            );
            Ok(true)
        }
        Err(Error::AppendConditionFailed { matching, .. }) => {
            println!(
                "{user}: condition failed, events {matching:?} appeared since the decision; nothing appended"
            );
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

#[tokio::main]
async fn main() -> Result {
    let db = support::scratch("dcb_decision").await?;
    // The default strategy: per-tag advisory locks (READ COMMITTED inside);
    // SERIALIZABLE and a table lock are the other two.
    let store = EventStore::new(db.pool.clone(), EventStoreConfig::default())?;

    // Two registrations of "alice" decide concurrently: both see it free.
    let first = store.decide(&about("alice")?).await?;
    let second = store.decide(&about("alice")?).await?;
    println!(
        "u1 and u2 decide at position {:?}: {} claim(s) of \"alice\" seen",
        first.after,
        first.events.len()
    );

    // Someone registers "bob" meanwhile: outside both conditions.
    let bob = store.decide(&about("bob")?).await?;
    assert!(register(&store, "bob", "u3", &bob).await?);
    // The first append commits; the second's condition now fails.
    assert!(register(&store, "alice", "u1", &first).await?);
    assert!(!register(&store, "alice", "u2", &second).await?);
    // u2 decides again and sees the name taken.
    let again = store.decide(&about("alice")?).await?;
    assert!(!register(&store, "alice", "u2", &again).await?);

    let claims = store.read(&about("alice")?, Default::default()).await?;
    println!(
        "claims of \"alice\": {} (owner {})",
        claims.len(),
        claims[0].event.data["user"]
    );
    assert_eq!(claims.len(), 1, "one claim per username");
    db.finish().await
}
