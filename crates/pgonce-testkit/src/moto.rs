//! A throwaway SQS server: moto's server (PyPI `moto[server]`, installed
//! by `scripts/ensure-moto.sh`), with one fix and faults to order
//! ([`Moto::FAIL_REQUEST`], [`Moto::FAIL_ENTRY`]) applied at start
//! (`moto_server.py`), on a free loopback port, in its own process group,
//! stopped when dropped. The SQS backend's tests, the
//! lab's SQS pipeline test and `pgonce demo --queue sqs` all start it here.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// How long moto may take to answer its first request.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// Why moto could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MotoError {
    /// `python3` is not on PATH.
    #[error(
        "python3 is not installed; moto needs it: run `source scripts/ensure-moto.sh` \
         (pip install 'moto[server]') or use scripts/test"
    )]
    NotInstalled,
    /// It was found but did not come up.
    #[error("moto did not come up: {0}")]
    Start(String),
}

/// A running moto server, listening on 127.0.0.1 only.
#[derive(Debug)]
pub struct Moto {
    child: Child,
    endpoint: String,
}

impl Moto {
    /// A receipt handle that fails the DeleteMessageBatch request naming
    /// it, whole, as SQS fails a throttled request (`RequestThrottled`):
    /// nothing of that request is deleted. moto has no way to fail a
    /// request; `moto_server.py` adds this one.
    /// As a message body, it fails the SendMessageBatch request that
    /// carries it, whole, in the same way: nothing of that request is sent.
    /// Anywhere in a SendMessage's body, it fails that send so.
    pub const FAIL_REQUEST: &str = "pgonce-testkit-fail-this-request";

    /// A message body that SendMessageBatch refuses alone: the request
    /// sends its other messages and reports this one in its `Failed` list,
    /// as SQS does an entry KMS throttled (`KMS.ThrottlingException`): a
    /// request taken in part.
    pub const FAIL_ENTRY: &str = "pgonce-testkit-fail-this-entry";

    /// Starts moto and waits until it answers HTTP (a second or two).
    pub fn start() -> Result<Moto, MotoError> {
        let mut last = String::new();
        // A port picked free can be taken before moto binds it: try again.
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| MotoError::Start(format!("no free loopback port: {e}")))?
                .port();
            // moto's own server, started through a launcher that fixes a
            // race of its SQS backend (see moto_server.py).
            let child = Command::new("python3")
                .args(["-c", include_str!("moto_server.py")])
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                // Its own group, so Drop stops any helper it forks.
                .process_group(0)
                .spawn()
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => MotoError::NotInstalled,
                    _ => MotoError::Start(e.to_string()),
                })?;
            let mut moto = Moto {
                child,
                endpoint: format!("http://127.0.0.1:{port}"),
            };
            match moto.wait_ready(([127, 0, 0, 1], port).into()) {
                Ok(()) => return Ok(moto),
                Err(e) => last = e,
            }
        }
        Err(MotoError::Start(last))
    }

    /// Its base URL, e.g. `http://127.0.0.1:41234`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Polls until moto answers an HTTP request; fails early if the process
    /// exited.
    fn wait_ready(&mut self, addr: SocketAddr) -> Result<(), String> {
        let deadline = Instant::now() + READY_WITHIN;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Err(format!("moto exited: {status}"));
            }
            if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let req = "GET /moto-api/ HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
                let mut buf = [0u8; 12];
                if s.write_all(req.as_bytes()).is_ok()
                    && s.read_exact(&mut buf).is_ok()
                    && buf.starts_with(b"HTTP/1.")
                {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!("no HTTP answer within {READY_WITHIN:?}"))
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        // The whole process group: moto may fork helpers.
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = killpg(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = killpg(pid, Signal::SIGKILL);
        let _ = self.child.wait();
    }
}
