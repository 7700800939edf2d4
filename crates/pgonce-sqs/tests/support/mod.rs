//! Test support: a throwaway moto server (pgonce-testkit's [`Moto`]) and a
//! client on it.

use pgonce_sqs::{SqsClient, SqsConfig};
pub use pgonce_testkit::Moto;

/// Starts moto; panics with the reason (not installed, did not come up).
pub fn start() -> Moto {
    Moto::start().unwrap_or_else(|e| panic!("{e}"))
}

/// A client of `moto`.
pub async fn client(moto: &Moto) -> SqsClient {
    SqsClient::connect(SqsConfig::local(moto.endpoint()))
        .await
        .expect("SDK config")
}
