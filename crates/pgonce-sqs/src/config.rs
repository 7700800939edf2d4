//! How to reach SQS: [`SqsConfig`].

use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_sdk_sqs::config::{Credentials, Region};
use pgonce::{Error, Result};

/// Why an `https://` endpoint, or none (real AWS), is refused by a build
/// without TLS. This crate cannot tell which program it is built into, so
/// it names its own feature and the one of the `pgonce` command that turns
/// it on.
#[cfg(not(feature = "tls"))]
const HTTPS_NEEDS_TLS: &str = "HTTPS endpoints (real AWS) need a build with TLS: \
     the `pgonce` command built with `--features sqs-tls`, or a program of your own \
     with pgonce-sqs's `tls` feature; without it give an http:// endpoint_url";

/// The shortest [`SqsConfig::operation_timeout`].
pub const MIN_OPERATION_TIMEOUT: Duration = Duration::from_millis(100);

/// The longest [`SqsConfig::operation_timeout`].
pub const MAX_OPERATION_TIMEOUT: Duration = Duration::from_secs(300);

/// Where SQS is and how long a call may take.
///
/// Everything left `None` comes from the standard AWS configuration
/// (`AWS_REGION`, `AWS_ENDPOINT_URL_SQS`/`AWS_ENDPOINT_URL`,
/// `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `~/.aws/config` and
/// `~/.aws/credentials` profiles, container and instance roles).
#[derive(Debug, Clone)]
pub struct SqsConfig {
    /// Overrides the endpoint, e.g. `http://127.0.0.1:5000` for a local
    /// server (moto, ElasticMQ). Default: none (the standard configuration,
    /// else the region's AWS endpoint).
    pub endpoint_url: Option<String>,
    /// Overrides the region. Default: none (the standard configuration;
    /// `us-east-1` when that names none either).
    pub region: Option<String>,
    /// Overrides the credentials. Default: none (the standard chain).
    pub credentials: Option<Credentials>,
    /// The longest one queue call may take, retries included; a receive's
    /// long-polling wait is added on top. Past it the call fails with
    /// [`Error::Unavailable`]. Default 10 s; 100 ms to 5 min.
    pub operation_timeout: Duration,
    /// Attempts per call on throttling and transport errors (1: no retry).
    /// A send to a standard queue is attempted again only where SQS did
    /// not take the attempt before (see `SqsQueue`, Retries). Default 3; 1
    /// to 10.
    pub max_attempts: u32,
}

impl Default for SqsConfig {
    fn default() -> Self {
        SqsConfig {
            endpoint_url: None,
            region: None,
            credentials: None,
            operation_timeout: Duration::from_secs(10),
            max_attempts: 3,
        }
    }
}

impl SqsConfig {
    /// A local server at `endpoint_url` with dummy credentials and region
    /// `us-east-1` (what moto and ElasticMQ accept).
    pub fn local(endpoint_url: impl Into<String>) -> SqsConfig {
        SqsConfig {
            endpoint_url: Some(endpoint_url.into()),
            region: Some("us-east-1".into()),
            credentials: Some(Credentials::new(
                "testing",
                "testing",
                None,
                None,
                "pgonce-sqs-local",
            )),
            ..SqsConfig::default()
        }
    }

    /// Sets the operation timeout.
    pub fn operation_timeout(mut self, timeout: Duration) -> SqsConfig {
        self.operation_timeout = timeout;
        self
    }

    /// Checks the ranges stated on each field.
    pub fn validate(&self) -> Result<()> {
        let invalid = |why: &str| {
            Err(Error::Invalid {
                what: "SQS config",
                why: why.into(),
            })
        };
        if !(MIN_OPERATION_TIMEOUT..=MAX_OPERATION_TIMEOUT).contains(&self.operation_timeout) {
            return invalid("the operation timeout is 100 ms to 5 minutes");
        }
        if !(1..=10).contains(&self.max_attempts) {
            return invalid("max_attempts is 1 to 10");
        }
        if let Some(url) = &self.endpoint_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return invalid("the endpoint URL must start with http:// or https://");
        }
        #[cfg(not(feature = "tls"))]
        if self
            .endpoint_url
            .as_deref()
            .is_none_or(|u| u.starts_with("https://"))
        {
            return invalid(HTTPS_NEEDS_TLS);
        }
        Ok(())
    }

    pub(crate) fn timeouts(&self, extra: Duration) -> TimeoutConfig {
        TimeoutConfig::builder()
            .operation_timeout(self.operation_timeout + extra)
            .connect_timeout(self.operation_timeout.min(Duration::from_secs(3)))
            .build()
    }

    /// Loads the SDK configuration: the standard chain, then the overrides.
    pub(crate) async fn load(&self) -> Result<aws_sdk_sqs::Client> {
        self.validate()?;
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .timeout_config(self.timeouts(Duration::ZERO))
            .retry_config(RetryConfig::standard().with_max_attempts(self.max_attempts));
        #[cfg(not(feature = "tls"))]
        {
            loader = loader.http_client(aws_smithy_http_client::Builder::new().build_http());
        }
        if let Some(url) = &self.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        if let Some(region) = &self.region {
            loader = loader.region(Region::new(region.clone()));
        }
        if let Some(credentials) = &self.credentials {
            loader = loader.credentials_provider(credentials.clone());
        }
        let shared = loader.load().await;
        let mut builder = aws_sdk_sqs::config::Builder::from(&shared);
        if shared.region().is_none() {
            builder = builder.region(Region::new("us-east-1"));
        }
        Ok(aws_sdk_sqs::Client::from_conf(builder.build()))
    }
}

#[cfg(all(test, not(feature = "tls")))]
mod tests {
    use super::*;

    /// A build without TLS refuses an `https://` endpoint, and none (the
    /// region's AWS endpoint), saying what to build for either program: it
    /// named only "pgonce-sqs's `tls` feature", a name the `pgonce` command
    /// does not have (its feature is `sqs-tls`).
    #[test]
    fn a_build_without_tls_refuses_https_naming_the_command_and_crate_features() {
        for endpoint_url in [None, Some("https://sqs.eu-west-1.amazonaws.com".to_owned())] {
            let config = SqsConfig {
                endpoint_url,
                ..SqsConfig::default()
            };
            let e = config.validate().unwrap_err().to_string();
            for needle in [
                "`pgonce` command built with `--features sqs-tls`",
                "pgonce-sqs's `tls` feature",
            ] {
                assert!(e.contains(needle), "{needle}: {e}");
            }
        }
        SqsConfig::local("http://127.0.0.1:5000")
            .validate()
            .unwrap();
    }
}
