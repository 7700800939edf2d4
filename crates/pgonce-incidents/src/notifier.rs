//! Notifications, sent once although their job may be delivered twice:
//! creating an incident enqueued a notification job in the same transaction,
//! its payload ([`NotificationPayload`]) keeping a key drawn then; the
//! [`Notifier`] claims such jobs (two-phase, with a lease), POSTs a webhook
//! carrying that key in an `Idempotency-Key` header, and completes the job
//! together with the `notifications` row.
//!
//! What it guarantees (I3): each incident's job completes once, and at most
//! one `notifications` row exists per incident. The POST itself is at least
//! once: a notifier that crashes (or times out) after the receiver got the
//! request, before completing, leaves the job to be retried (by
//! [`pgonce::job::Redriver`] after a failure, or [`pgonce::job::Reaper`]
//! after a crash), and the retry carries the same key, which the receiver
//! uses to drop the duplicate. A notifier whose lease was taken over cannot
//! complete ([`pgonce::Error::LeaseLost`]): nothing written.
//!
//! The key is the notification's, not the incident id's: ids are unique in
//! one database only. Two installations posting to one receiver, or a
//! database restored from a backup (its sequence hands out again ids
//! notified after the backup), would send one id's key for two incidents,
//! and the receiver would drop the second as a repeat: a notification seen
//! zero times.

use std::future::Future;
use std::time::Duration;

use pgonce::job::{self, ClaimedJob, FailOutcome, RetryPolicy};
use serde_json::{Value, json};
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::service::{NOTIFY_JOB_KIND, Service};

/// The header that names a request for its retries: it carries a
/// notification's idempotency key, and the API reads it on declarations
/// and observations.
pub const IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// The payload of a notification job ([`NOTIFY_JOB_KIND`]), as JSON
/// `{"incident_id": n, "idempotency_key": "<uuid>"}`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NotificationPayload {
    /// The incident notified.
    pub incident_id: i64,
    /// A random (version 4) UUID drawn when the job was enqueued, in the
    /// incident's transaction: every attempt of this notification sends it,
    /// and no other notification does, whichever database it comes from.
    /// `None` in the jobs of builds before it, which send the key those
    /// builds sent ([`NotificationPayload::idempotency_key`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<Uuid>,
}

impl NotificationPayload {
    /// The payload of `incident_id`'s notification, its key drawn now.
    pub fn new(incident_id: i64) -> NotificationPayload {
        NotificationPayload {
            incident_id,
            idempotency_key: Some(Uuid::new_v4()),
        }
    }

    /// Reads a claimed job's payload; the JSON error for one that is not a
    /// notification's (no integer `incident_id`, a key that is not a UUID).
    pub fn from_job(
        payload: &Value,
    ) -> std::result::Result<NotificationPayload, serde_json::Error> {
        serde::Deserialize::deserialize(payload)
    }

    /// The payload as the job stores it.
    pub fn to_job(&self) -> Value {
        serde_json::to_value(self).expect("an integer and a UUID serialize")
    }

    /// The `Idempotency-Key` of this notification, the same for every
    /// attempt: the kept UUID, hyphenated. A job enqueued by a build before
    /// it sends that build's key, `incident-<id>`: the receiver may hold
    /// the POST of an attempt that build made, and drops a retry of it only
    /// by that key.
    pub fn idempotency_key(&self) -> String {
        match self.idempotency_key {
            Some(key) => key.hyphenated().to_string(),
            None => format!("incident-{}", self.incident_id),
        }
    }
}

/// The shortest [`RetryPolicy::base`] of a [`NotifierConfig`]: 1 ms. Each
/// delay doubles the one before from `base`, so a base of zero makes every
/// delay zero: a failed send is sent again at once, again and again, until
/// the notification has used up its attempts.
pub const MIN_RETRY_BASE: Duration = Duration::from_millis(1);

/// Settings of a [`Notifier`].
#[derive(Debug, Clone, PartialEq)]
pub struct NotifierConfig {
    /// Where to POST: an `http` or `https` URL (TLS by rustls, with the
    /// bundled Mozilla roots). Required. Redirects are not followed: a 3xx
    /// answer is a failed send, retried like a 5xx.
    pub webhook_url: String,
    /// Jobs claimed per pass. Default 16; at least 1.
    pub batch: i64,
    /// Lease of a claim; a notifier that has not completed by then may be
    /// taken over. Default 30 s; must exceed `timeout`.
    pub lease: Duration,
    /// Timeout of one POST. Default 5 s.
    pub timeout: Duration,
    /// Pause of [`Notifier::run`] when there was nothing to send. Default
    /// 100 ms. After a failed pass the pause doubles with each failure in
    /// a row, from twice `idle` up to [`FAILED_PASSES_PAUSE_AT_MOST`] (or
    /// `idle`, if longer), and is `idle` again after a pass that succeeds.
    pub idle: Duration,
    /// Backoff of failed sends. Default [`RetryPolicy::default`]; its
    /// `base` at least [`MIN_RETRY_BASE`]. A 429 or 503 answer's
    /// `Retry-After` (seconds or an HTTP date) is waited when longer than
    /// the backoff, up to `max`.
    pub retry: RetryPolicy,
}

impl NotifierConfig {
    /// Settings that post to `webhook_url`, every other field at its default.
    /// Checked by [`NotifierConfig::validate`], not here.
    pub fn new(webhook_url: impl Into<String>) -> NotifierConfig {
        NotifierConfig {
            webhook_url: webhook_url.into(),
            batch: 16,
            lease: Duration::from_secs(30),
            timeout: Duration::from_secs(5),
            idle: Duration::from_millis(100),
            retry: RetryPolicy::default(),
        }
    }

    /// Checks the URL (http or https), the batch (at least 1), that the lease
    /// exceeds the timeout, that idle is above zero, and the retry policy
    /// (its base at least [`MIN_RETRY_BASE`]);
    /// otherwise [`Error::Invalid`].
    pub fn validate(&self) -> Result<()> {
        let url = reqwest::Url::parse(&self.webhook_url)
            .map_err(|e| Error::invalid("webhook_url", e.to_string()))?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(Error::invalid("webhook_url", "must be http or https"));
        }
        if self.batch < 1 {
            return Err(Error::invalid("notifier batch", "at least 1"));
        }
        if self.lease <= self.timeout
            || self.lease > pgonce::job::MAX_LEASE
            || self.timeout.is_zero()
            || self.idle.is_zero()
        {
            return Err(Error::invalid(
                "notifier config",
                "lease must exceed timeout and be at most 365 days, and timeout and idle be \
                 above zero",
            ));
        }
        if self.retry.base < MIN_RETRY_BASE {
            return Err(Error::invalid(
                "notifier retry base",
                "at least 1 ms (a base of zero retries a failed send at once)",
            ));
        }
        self.retry.validate()?;
        Ok(())
    }
}

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct NotifyCounts {
    /// Delivered and completed.
    pub sent: u64,
    /// Sends that failed (error status, timeout, refused): retried later.
    pub failed: u64,
    /// Jobs past their maximum attempts.
    pub dead: u64,
    /// Completions refused because the lease had been taken over.
    pub lease_lost: u64,
    /// Jobs whose handling hit a database error (logged). Each stays
    /// claimed until its lease runs out; the reaper then offers it again,
    /// and the retry carries the same idempotency key.
    pub errors: u64,
}

impl std::ops::AddAssign for NotifyCounts {
    fn add_assign(&mut self, o: NotifyCounts) {
        self.sent += o.sent;
        self.failed += o.failed;
        self.dead += o.dead;
        self.lease_lost += o.lease_lost;
        self.errors += o.errors;
    }
}

/// Sends incident notifications; see the module docs.
#[derive(Debug, Clone)]
pub struct Notifier {
    pool: PgPool,
    client: reqwest::Client,
    config: NotifierConfig,
}

/// What a notification says about an incident, as
/// `notifier/sql/incident.sql` returns it.
#[derive(sqlx::FromRow)]
struct IncidentSummary {
    id: i64,
    organization_id: i64,
    organization_name: String,
    number: i64,
    title: String,
    lifecycle: String,
    opened_at: OffsetDateTime,
}

enum Sent {
    Delivered(u16),
    /// Why, and how long the receiver asked to be left alone (a 429's or
    /// 503's `Retry-After`), if it did.
    Failed(String, Option<Duration>),
}

impl Notifier {
    /// A notifier on the service's pool. [`Error::Invalid`] for a config that
    /// fails [`NotifierConfig::validate`] or an HTTP client that cannot be built.
    pub fn new(service: &Service, config: NotifierConfig) -> Result<Notifier> {
        config.validate()?;
        // Redirects are not followed: a 301, 302 or 303 turns the POST
        // into a GET without the notification, whose 2xx would be recorded
        // as a delivery. A 3xx is an answer like any non-2xx: a failed send.
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(config.timeout)
            .build()
            .map_err(|e| Error::invalid("http client", e.to_string()))?;
        Ok(Notifier {
            pool: service.pool().clone(),
            client,
            config,
        })
    }

    /// One pass: claims up to `batch` jobs and sends them concurrently.
    /// An error is returned only when nothing could be claimed; a job that
    /// fails on its own is counted in [`NotifyCounts::errors`], and the
    /// others of the pass are still sent and counted.
    pub async fn run_once(&self) -> Result<NotifyCounts> {
        let jobs = job::claim_batch(
            &self.pool,
            NOTIFY_JOB_KIND,
            self.config.batch,
            self.config.lease,
        )
        .await?;
        let outcomes = futures::future::join_all(jobs.into_iter().map(|j| async move {
            let job_id = j.lease.job_id;
            self.notify(j).await.unwrap_or_else(|e| {
                tracing::warn!(
                    job = job_id,
                    "notification job failed; the reaper retries it after its lease: {e}"
                );
                metrics::counter!("pgonce_incidents_notification_errors_total").increment(1);
                NotifyCounts {
                    errors: 1,
                    ..NotifyCounts::default()
                }
            })
        }))
        .await;
        let mut counts = NotifyCounts::default();
        for outcome in outcomes {
            counts += outcome;
        }
        Ok(counts)
    }

    /// Runs passes until `shutdown` resolves. A pass that fails (the
    /// database down, refusing logins) is retried after a pause that
    /// doubles with each failure in a row, up to
    /// [`FAILED_PASSES_PAUSE_AT_MOST`] (see [`NotifierConfig::idle`]), so
    /// that a database that is down is not asked ten times a second; each
    /// is counted in `pgonce_service_failed_passes_total{service="notifier"}`
    /// and logged as [`pgonce::service::FailingPasses`] does: the first at
    /// warn, then a warn line a minute at most while they go on, and one
    /// info line once a pass succeeds again.
    ///
    /// A pass in flight at shutdown is finished, within the lease: its
    /// webhooks may already hold their notifications, and a pass dropped
    /// there would leave its jobs claimed until their leases ran out, then
    /// posted again. Past the lease the jobs may be taken over, so the pass
    /// is dropped then, as a crash would drop it.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> NotifyCounts {
        use futures::FutureExt;
        tokio::pin!(shutdown);
        let mut total = NotifyCounts::default();
        let mut failing = pgonce::service::FailingPasses::new("notifier");
        loop {
            // No claim once shutdown has resolved.
            if (&mut shutdown).now_or_never().is_some() {
                return total;
            }
            let pass = self.run_once();
            tokio::pin!(pass);
            let (pass, stopping) = tokio::select! {
                biased;
                r = &mut pass => (r, false),
                _ = &mut shutdown => match tokio::time::timeout(self.config.lease, &mut pass).await {
                    Ok(r) => (r, true),
                    Err(_) => {
                        tracing::warn!(
                            "notifier pass still running when its lease ran out at shutdown; \
                             dropped, its jobs are retried after their leases"
                        );
                        return total;
                    }
                },
            };
            let pause = match pass {
                Ok(c) => {
                    failing.succeeded();
                    total += c;
                    (c == NotifyCounts::default()).then_some(self.config.idle)
                }
                Err(e) => Some(pause_after_failed_passes(
                    self.config.idle,
                    failing.failed(&e),
                )),
            };
            if stopping {
                return total;
            }
            if let Some(pause) = pause {
                tokio::select! {
                    _ = &mut shutdown => return total,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }

    async fn notify(&self, claimed: ClaimedJob) -> Result<NotifyCounts> {
        let lease = &claimed.lease;
        let mut counts = NotifyCounts::default();
        let payload = NotificationPayload::from_job(&claimed.payload);
        let sent = match &payload {
            Err(why) => Sent::Failed(
                format!("malformed payload {}: {why}", claimed.payload),
                None,
            ),
            Ok(payload) => self.send(payload).await?,
        };
        let payload = payload.ok();
        match sent {
            Sent::Delivered(status) => {
                let mut tx =
                    pgonce::begin(&self.pool, pgonce::IsolationLevel::ReadCommitted).await?;
                match job::complete(&mut *tx, lease, &json!({ "status": status })).await {
                    Ok(()) => {}
                    Err(pgonce::Error::LeaseLost { .. }) => {
                        counts.lease_lost += 1;
                        return Ok(counts);
                    }
                    Err(e) => return Err(e.into()),
                }
                sqlx::query(include_str!("notifier/sql/record.sql"))
                    .bind(payload.as_ref().map(|p| p.incident_id))
                    .bind(payload.as_ref().map(NotificationPayload::idempotency_key))
                    .bind(claimed.attempts + 1)
                    .bind(i32::from(status))
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                counts.sent += 1;
                metrics::counter!("pgonce_incidents_notifications_sent_total").increment(1);
            }
            Sent::Failed(why, retry_after) => {
                tracing::warn!(job = lease.job_id, "notification failed: {why}");
                metrics::counter!("pgonce_incidents_notifications_failed_total").increment(1);
                let retry = match retry_after {
                    Some(asked) => waiting_at_least(&self.config.retry, claimed.attempts, asked),
                    None => self.config.retry,
                };
                match job::fail(&self.pool, lease, &why, &retry).await {
                    Ok(FailOutcome::Retry { .. }) => counts.failed += 1,
                    Ok(FailOutcome::Dead { .. }) => {
                        counts.failed += 1;
                        counts.dead += 1;
                    }
                    Err(pgonce::Error::LeaseLost { .. }) => counts.lease_lost += 1,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(counts)
    }

    /// One POST; any transport error, a timeout, or a non-2xx status (a
    /// redirect too) is a failure to retry, its reason what the job keeps
    /// (`webhook answered ...`, `webhook did not answer within ...`,
    /// `webhook unreachable: ...`).
    async fn send(&self, payload: &NotificationPayload) -> Result<Sent> {
        let incident_id = payload.incident_id;
        let row: Option<IncidentSummary> =
            sqlx::query_as(include_str!("notifier/sql/incident.sql"))
                .bind(incident_id)
                .fetch_optional(&self.pool)
                .await?;
        let Some(IncidentSummary {
            id,
            organization_id,
            organization_name,
            number,
            title,
            lifecycle,
            opened_at,
        }) = row
        else {
            return Ok(Sent::Failed(
                format!("incident {incident_id} does not exist"),
                None,
            ));
        };
        let body = json!({
            "incident_id": id,
            "organization_id": organization_id,
            "organization": organization_name,
            "number": number,
            "title": title,
            "lifecycle": lifecycle,
            "opened_at": opened_at.unix_timestamp(),
        });
        let response = self
            .client
            .post(&self.config.webhook_url)
            .header(IDEMPOTENCY_HEADER, payload.idempotency_key())
            .json(&body)
            .send()
            .await;
        Ok(match response {
            Ok(r) if r.status().is_success() => Sent::Delivered(r.status().as_u16()),
            Ok(r) => Sent::Failed(format!("webhook answered {}", r.status()), retry_after(&r)),
            // Not "unreachable": the receiver may hold the request, and may
            // have taken the notification (the retry carries the same key).
            Err(e) if e.is_timeout() => Sent::Failed(
                format!("webhook did not answer within {:?}", self.config.timeout),
                None,
            ),
            // Without the URL, which the error names in full: a webhook's
            // path or query is often its secret, and this reason is kept on
            // the job and logged.
            Err(e) => Sent::Failed(
                format!("webhook unreachable: {}", with_causes(&e.without_url())),
                None,
            ),
        })
    }
}

/// The longest pause of [`Notifier::run`] after failed passes (unless
/// [`NotifierConfig::idle`] is longer): once the database is back,
/// notifications go out again within it.
pub const FAILED_PASSES_PAUSE_AT_MOST: Duration = Duration::from_secs(30);

/// The pause of [`Notifier::run`] after `failed` passes in a row failed:
/// `idle` doubled for each, at most [`FAILED_PASSES_PAUSE_AT_MOST`] (or
/// `idle`, if longer). By hand: one saturating product, which no crate
/// of the workspace's dependencies computes (a backoff crate would come
/// in for this line alone).
fn pause_after_failed_passes(idle: Duration, failed: u64) -> Duration {
    let doublings = u32::try_from(failed).unwrap_or(u32::MAX).min(31);
    idle.saturating_mul(1 << doublings)
        .min(FAILED_PASSES_PAUSE_AT_MOST.max(idle))
}

/// How long a 429 (too many requests) or 503 (unavailable) answer asks
/// the sender to wait: its `Retry-After`, in seconds or as an HTTP date
/// (RFC 9110, 10.2.3). `None` for another status, no header, or one that
/// is neither; a date already past is no wait.
fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    use reqwest::StatusCode;
    if !matches!(
        response.status(),
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    ) {
        return None;
    }
    let value = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

/// The retry of a job that failed after its `attempts` earlier ones, the
/// receiver having asked for `asked` before the next: the backoff `policy`
/// gives it, or `asked` when longer, never past `policy.max` (a receiver
/// that asks for a year, or garbage read as one, does not park the job
/// past the operator's bound). The SQL of [`job::fail`] waits
/// `min(max, base * 2^attempts)`: a policy whose base and max are both the
/// wait makes it that wait, jitter kept.
fn waiting_at_least(policy: &RetryPolicy, attempts: i32, asked: Duration) -> RetryPolicy {
    let backoff = policy
        .base
        .saturating_mul(2u32.saturating_pow(attempts.clamp(0, 31).unsigned_abs()))
        .min(policy.max);
    let wait = backoff.max(asked.min(policy.max));
    RetryPolicy {
        base: wait,
        max: wait,
        jitter: policy.jitter,
    }
}

/// `error` and its causes, outermost first, joined by `: `: reqwest's own
/// text stops at "error sending request", without why (refused, reset, a
/// certificate refused). By hand: a walk of `source()`, which no crate here
/// does for a plain `std::error::Error` (anyhow would come in for this
/// alone).
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pause after failed passes doubles from twice `idle`, stops
    /// growing at its bound (or `idle`, if longer), and never overflows.
    #[test]
    fn the_pause_after_failed_passes_doubles_up_to_its_bound() {
        let idle = Duration::from_millis(100);
        let pauses: Vec<Duration> = (1..=10)
            .map(|failed| pause_after_failed_passes(idle, failed))
            .collect();
        let ms = Duration::from_millis;
        assert_eq!(
            pauses,
            [
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(3200),
                ms(6400),
                ms(12800),
                ms(25600),
                FAILED_PASSES_PAUSE_AT_MOST,
                FAILED_PASSES_PAUSE_AT_MOST
            ]
        );
        assert_eq!(
            pause_after_failed_passes(idle, u64::MAX),
            FAILED_PASSES_PAUSE_AT_MOST
        );
        let long_idle = Duration::from_secs(120);
        assert_eq!(pause_after_failed_passes(long_idle, 1), long_idle);
        assert_eq!(
            pause_after_failed_passes(Duration::from_secs(u64::MAX), 40),
            Duration::from_secs(u64::MAX)
        );
    }
}
