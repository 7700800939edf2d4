//! disintegrate-postgres 4.0.1 (crates.io) doing the work of `pgonce bench
//! events`, on the run's scratch database (its own `public.event` table, on
//! its own sqlx 0.8 pool), in the same process.
//!
//! The workload is pgonce's: each operation is a decision read on the
//! writer's tag and an append of one `Booked` event carrying that tag,
//! conditioned on it. The tag is disintegrate's domain id `bench_id` (a
//! column with a partial index, as its migrator creates; the schema comes
//! from `sql/disintegrate_init.sql`, its migrator's SQL made to run on
//! PostgreSQL 15). The decision read
//! is `EventStore::stream`, whose `StreamItem::End` gives the version, as
//! disintegrate's `DecisionMaker` does; the append is `EventStore::append`,
//! which checks the condition the way disintegrate does it: one transaction
//! at SERIALIZABLE, `EXISTS` on the query after the version, then the insert,
//! and a 40001 at commit reported as `Error::Concurrency`.
//!
//! Outcomes: `conflicts` counts `Error::Concurrency` (disintegrate does not
//! tell a failed condition from a serialization failure at commit, so this
//! includes both), `aborts` counts serialization failures raised before
//! commit (rolled back after their work). disintegrate does not retry: the
//! caller would re-run the decision.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use disintegrate::{
    DomainIdInfo, DomainIdSet, Event, EventInfo, EventSchema, EventStore, IdentifierType,
    StreamFilter, StreamItem, domain_ids, ident,
};
use disintegrate_postgres::{Error as PgError, PgEventStore};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::bench::events::Overlap;
use crate::bench::measure::{Measured, closed_loop};
use crate::scratch::RunDatabase;

/// The strategy name in the events report.
pub(crate) const NAME: &str = "disintegrate-postgres";

/// The bench's one event: a booking under the writer's tag.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Booked {
    bench_id: String,
}

impl Event for Booked {
    const SCHEMA: EventSchema = EventSchema {
        events: &["Booked"],
        events_info: &[&EventInfo {
            name: "Booked",
            domain_ids: &[&ident!(#bench_id)],
        }],
        domain_ids: &[&DomainIdInfo {
            ident: ident!(#bench_id),
            type_info: IdentifierType::String,
        }],
    };

    fn domain_ids(&self) -> DomainIdSet {
        domain_ids! {bench_id: self.bench_id}
    }

    fn name(&self) -> &'static str {
        "Booked"
    }
}

/// JSON payloads, as pgonce stores them (disintegrate's own JSON serde
/// would need one more feature for the same bytes).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Json;

impl disintegrate_serde::Serializer<Booked> for Json {
    fn serialize(&self, value: Booked) -> Vec<u8> {
        serde_json::to_vec(&value).expect("a struct of strings serialises")
    }
}

impl disintegrate_serde::Deserializer<Booked> for Json {
    fn deserialize(&self, data: Vec<u8>) -> Result<Booked, disintegrate_serde::Error> {
        serde_json::from_slice(&data)
            .map_err(|e| disintegrate_serde::Error::Deserialization(Box::new(e)))
    }
}

/// disintegrate's event store on the run's database.
pub(crate) struct Peer {
    store: PgEventStore<Booked, Json>,
}

impl Peer {
    /// Connects a sqlx 0.8 pool of `max_connections` to the scratch
    /// database, lets disintegrate create its schema, and seeds `seeded`
    /// events of another type, as the pgonce side is seeded.
    pub(crate) async fn open(
        db: &RunDatabase,
        max_connections: u32,
        seeded: i64,
    ) -> anyhow::Result<Peer> {
        let pool = super::sqlx08_pool(db, max_connections, "disintegrate").await?;
        // `PgEventStore::try_new` runs disintegrate's migrator, whose SQL
        // needs PostgreSQL 16; the same schema, written for 15 (see the file).
        sqlx08::raw_sql(include_str!("sql/disintegrate_init.sql"))
            .execute(&pool)
            .await
            .context("disintegrate's schema")?;
        let store = PgEventStore::new_uninitialized(pool.clone(), Json);
        sqlx08::query(
            "INSERT INTO event (event_type, payload, bench_id)
             SELECT 'Seeded', convert_to('null', 'UTF8'), 'seed:' || i
             FROM generate_series(1, $1) AS i",
        )
        .bind(seeded)
        .execute(&pool)
        .await?;
        sqlx08::query("ANALYZE event").execute(&pool).await?;
        Ok(Peer { store })
    }

    /// The events bench's closed loop with disintegrate's read and append.
    pub(crate) async fn measure(
        &self,
        overlap: Overlap,
        workers: usize,
        phase: Duration,
        label: &str,
    ) -> Measured {
        let store = Arc::new(self.store.clone());
        closed_loop(label, workers, phase, move |worker, _| {
            let store = store.clone();
            async move {
                let tag = overlap.tag(worker);
                let query = disintegrate::query::<_, Booked, Booked>(Some(StreamFilter::new(
                    domain_ids! {bench_id: tag},
                )));
                let mut version = 0;
                let mut seen = 0usize;
                {
                    let mut stream = store.stream(&query);
                    while let Some(item) = stream.try_next().await? {
                        match item {
                            StreamItem::Event(_) => seen += 1,
                            StreamItem::End(end) => version = end,
                        }
                    }
                }
                std::hint::black_box(seen);
                match store
                    .append(vec![Booked { bench_id: tag }], query, version)
                    .await
                {
                    Ok(_) => Ok(None),
                    Err(PgError::Concurrency) => Ok(Some("conflicts")),
                    Err(PgError::Database(e))
                        if e.as_database_error()
                            .and_then(|d| d.code())
                            .is_some_and(|c| c == "40001") =>
                    {
                        Ok(Some("aborts"))
                    }
                    Err(e) => Err(e.into()),
                }
            }
        })
        .await
    }
}
