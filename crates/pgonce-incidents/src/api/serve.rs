//! Serving the router over HTTP/1.1 with hyper directly: `axum::serve` has
//! no header-read timeout, so a client that sends part of its headers, or
//! nothing, would hold a connection and a task for ever.
//!
//! * Headers must arrive within [`ApiConfig::header_timeout`]
//!   (`header_read_timeout`, which also bounds an idle keep-alive
//!   connection); else the connection is closed.
//! * Bodies must arrive within [`ApiConfig::body_timeout`] (checked where
//!   bodies are read: [`super::JsonBody`]; a JSON 408).
//! * An answer's write that the client leaves waiting (it reads none of
//!   the bytes, its receive window stays shut) fails after
//!   [`ApiConfig::write_timeout`], which closes the connection: hyper has
//!   no write timeout, and such a client would otherwise hold the
//!   connection, its task, and a graceful shutdown (which waits for every
//!   answer under way) for ever. The clock restarts at each write that
//!   makes progress, so a slow reader of a large answer is not cut off
//!   (`tokio_io_timeout::TimeoutWriter`).
//! * The HTTP layer's own answers to what it cannot parse (400, 414, 431)
//!   carry the API's `{"error": {"code", "message"}}` body like every other
//!   error: hyper writes them with an empty body and no hook to change it,
//!   so [`JsonErrors`] rewrites exactly those heads on their way out.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio_io_timeout::TimeoutWriter;

use super::ApiConfig;

/// Largest request head (request line and headers) in bytes; a larger one
/// is answered 431, however its bytes arrive, a long request target too
/// (hyper's `max_header_size`). The read buffer's bound (`max_buf_size`,
/// also this) is not that limit on its own: a buffer can be filled past it
/// by a read, so a head that arrives at once could pass it.
pub const MAX_HEAD: usize = 64 * 1024;

/// Serves `app` on `listener` until `shutdown` completes, then stops
/// accepting and waits for the connections in flight to finish their
/// current request. Timeouts from `config` (see the module docs).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    config: &ApiConfig,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_timeout)
        .max_header_size(MAX_HEAD)
        .max_buf_size(MAX_HEAD);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: pause rather
                    // than spin, and go on.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // tokio-io-timeout's writer: a write or flush left pending for
        // `write_timeout` fails with `TimedOut`; its clock restarts at each
        // write that makes progress. Boxed, as hyper wants `Unpin`.
        let mut stream = TimeoutWriter::new(stream);
        stream.set_timeout(Some(config.write_timeout));
        let stream = Box::pin(stream);
        let io = TokioIo::new(JsonErrors::new(stream));
        let connection = builder.serve_connection(io, TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A connection's byte stream whose writes pass through unchanged, except
/// an error answer hyper makes itself (400, 414 or 431 with an empty body),
/// which gets the API's JSON error body. The API's own answers always have
/// a body, so they are never taken for one.
pub struct JsonErrors<T> {
    inner: T,
    /// A rewritten answer being written: the bytes, how many are written,
    /// and the length of the caller's buffer to report once all are.
    pending: Option<(Vec<u8>, usize, usize)>,
}

impl<T> JsonErrors<T> {
    /// Wraps `inner`, with no answer pending.
    pub fn new(inner: T) -> JsonErrors<T> {
        JsonErrors {
            inner,
            pending: None,
        }
    }
}

/// The JSON version of `head` if it is one of hyper's own error answers.
fn rewrite(head: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(head).ok()?;
    let (lines, rest) = text.split_once("\r\n\r\n")?;
    if !rest.is_empty() {
        return None;
    }
    let mut lines = lines.split("\r\n");
    let status_line = lines.next()?;
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| status_line.strip_prefix("HTTP/1.0 "))?;
    let (code, message) = match status.get(..3)? {
        "400" => ("bad_request", "the request could not be parsed as HTTP"),
        "414" => ("uri_too_long", "the request target is too long"),
        "431" => (
            "header_fields_too_large",
            "the request's headers are too large",
        ),
        _ => return None,
    };
    let headers: Vec<&str> = lines.collect();
    if !headers
        .iter()
        .any(|h| h.eq_ignore_ascii_case("content-length: 0"))
    {
        return None;
    }
    let body = json!({"error": {"code": code, "message": message}}).to_string();
    let mut out = String::with_capacity(head.len() + body.len() + 64);
    out.push_str(status_line);
    out.push_str("\r\n");
    for h in headers {
        if !h.to_ascii_lowercase().starts_with("content-length:") {
            out.push_str(h);
            out.push_str("\r\n");
        }
    }
    out.push_str("content-type: application/json\r\n");
    out.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
    out.push_str(&body);
    Some(out.into_bytes())
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonErrors<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonErrors<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.pending.is_none() {
            match rewrite(buf) {
                Some(bytes) => this.pending = Some((bytes, 0, buf.len())),
                None => return Pin::new(&mut this.inner).poll_write(cx, buf),
            }
        }
        loop {
            let (bytes, written, reported) = this.pending.as_mut().expect("set above");
            if *written == bytes.len() {
                let reported = *reported;
                this.pending = None;
                return Poll::Ready(Ok(reported));
            }
            let n = ready!(Pin::new(&mut this.inner).poll_write(cx, &bytes[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hyper_s_empty_error_answers_are_rewritten() {
        let hyper_431 =
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let out = String::from_utf8(rewrite(hyper_431).unwrap()).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 "), "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "header_fields_too_large");
        // The API's own answers have a body: left alone.
        assert!(rewrite(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n").is_none());
        assert!(rewrite(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}").is_none());
        assert!(rewrite(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n").is_none());
    }
}
